"""What a run directory holds on disk: checkpoint tags, the COMPLETE and stop markers, file and
expert-key names. Standard library only: the Slurm job steps (launch.slurm_job, launch.status)
read it without loading torch.

    RUN_DIR/checkpoints/step_00000100/   one checkpoint (DeepSpeed files, rank_XXXXX.pt, COMPLETE)
    RUN_DIR/checkpoints/latest           the tag of the newest complete checkpoint, moved last
    RUN_DIR/STOPPED_ON_SIGNAL            the latest process run saved and stopped on a signal

A checkpoint is complete once its COMPLETE marker exists (written after every rank's files).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

COMPLETE = "COMPLETE"
LATEST = "latest"
STOP_MARKER = "STOPPED_ON_SIGNAL"
FAILURE_MARKER = "FAILED"  # RUN_DIR/FAILED: the error that ended the latest start, from the first rank it hit
# RUN_DIR/last_save_job: the Slurm job id of the newest save. Once a job has saved, its requeues and
# resubmissions resume the run's newest checkpoint, whatever train.resume its first start took
# (slurm/train.sbatch; launch.submit removes the file when it is given another train.resume).
LAST_SAVE_JOB = "last_save_job"
TAG_PATTERN = re.compile(r"^step_(\d+)$")

# DeepSpeed's file names inside a tag directory.
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# A routed expert's parameter: prefix, expert id (local in a module, global in an expert file), rest.
EXPERT_KEY = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked; the message says what is wrong and what to do."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def read_meta(tag_dir: Path) -> dict:
    """The COMPLETE marker of a checkpoint: model config, step, world size, tokenizer hash."""
    return json.loads((Path(tag_dir) / COMPLETE).read_text())


def latest_complete(ckpt_dir: Path) -> Path | None:
    """The checkpoint `latest` names if complete, else the newest complete one."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if tag and (ckpt_dir / tag / COMPLETE).is_file():
            return ckpt_dir / tag
    if not ckpt_dir.is_dir():
        return None
    complete = sorted(d for d in ckpt_dir.iterdir() if TAG_PATTERN.match(d.name) and (d / COMPLETE).is_file())
    return complete[-1] if complete else None


def latest_complete_step(run_dir: str | os.PathLike) -> int | None:
    path = latest_complete(checkpoint_dir(run_dir))
    if path is None:
        return None
    try:
        return int(read_meta(path)["step"])
    except (OSError, KeyError, ValueError, json.JSONDecodeError):
        return None


def resolve_resume(resume: str, run_dir: str) -> Path | None:
    """train.resume (auto | none | a tag directory) -> the checkpoint to resume, or None."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_complete(checkpoint_dir(run_dir))
    path = Path(resume)
    newest = latest_complete(checkpoint_dir(path)) if checkpoint_dir(path).is_dir() else None
    if newest is not None:  # a run directory, where a tag goes
        raise CheckpointError(
            f"train.resume={resume} is a run directory; give one of its checkpoints, e.g. train.resume={newest} "
            f"(its newest), or resume that run itself with run.dir={resume} train.resume=auto"
        )
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"train.resume={resume}: not a complete checkpoint (no {COMPLETE} marker); "
            "use train.resume=auto to pick the newest complete one, or train.resume=none to start afresh"
        )
    return path


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, synced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


ABANDONED = "abandoned"  # checkpoints/abandoned/<time>/: the tags after an explicitly resumed older one


def record_save_job(run_dir: str | os.PathLike) -> None:
    atomic_write(Path(run_dir) / LAST_SAVE_JOB, os.environ.get("SLURM_JOB_ID", "").encode())


def own_tag(run_dir: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether `path` is a tag directory of the run directory's own checkpoints."""
    path = Path(path).resolve()
    return path.parent == checkpoint_dir(run_dir).resolve() and bool(TAG_PATTERN.match(path.name))


def set_aside_newer(run_dir: str | os.PathLike, resumed: Path | None) -> list[str]:
    """When a run resumes an older checkpoint of its own (train.resume=RUN/checkpoints/step_X, a
    rollback), move the tags after it to checkpoints/abandoned/<time>/ and point `latest` at it: else
    the next train.resume=auto (every Slurm requeue) would resume the abandoned trajectory, and pruning
    by name would delete the new one. `resumed` None (train.resume=none) or a checkpoint of another
    run directory: all of the run's own, and no `latest`. Returns the tags moved. Rank 0 only, before
    any save."""
    ckpt_dir = checkpoint_dir(run_dir)
    # Another run's checkpoint: this run's own are another trajectory.
    resumed = Path(resumed).resolve() if resumed is not None and own_tag(run_dir, resumed) else None
    if not ckpt_dir.is_dir():
        return []
    newer = sorted(d for d in ckpt_dir.iterdir()
                   if TAG_PATTERN.match(d.name) and (resumed is None or d.name > resumed.name))
    if newer:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, n = ckpt_dir / ABANDONED / stamp, 1
        while aside.exists():  # a second set-aside within the second
            aside, n = ckpt_dir / ABANDONED / f"{stamp}-{n}", n + 1
        aside.mkdir(parents=True)
        for d in newer:
            d.rename(aside / d.name)
    if resumed is None:
        (ckpt_dir / LATEST).unlink(missing_ok=True)
    else:
        atomic_write(ckpt_dir / LATEST, resumed.name.encode())
    return [d.name for d in newer]


def saved_zero_family(meta: dict, path: Path) -> str | None:
    """How a checkpoint's optimizer and weights are laid out on disk: "0" (no ZeRO), "1-2" (ZeRO-1
    and 2 share it), "3" (weights partitioned too); for a marker from before the stage was recorded,
    told by its files; None without a marker's layout or DeepSpeed's files."""
    if "zero_stage" in meta:
        return zero_family(meta["zero_stage"])
    if meta.get("world_size") is None:
        return None
    path = Path(path)
    if any(path.glob("zero_pp_rank_*_model_states.pt")):
        return "3"
    if any(path.glob("*zero_pp_rank_*_optim_states.pt")):  # bf16_zero_pp_rank_* in bf16
        return "1-2"
    if any(path.glob("mp_rank_*_model_states.pt")):  # the optimizer state is in them
        return "0"
    return None  # no DeepSpeed files to tell by


def zero_family(stage: int) -> str:
    return {0: "0", 1: "1-2", 2: "1-2", 3: "3"}[stage]


def check_layout(meta: dict, world_size: int, tensor: int, global_batch: int, routed: bool, path: Path,
                 zero_stage: int | None = None, bf16: bool | None = None) -> bool:
    """Before anything is built: True when the checkpoint was saved at another data- or
    tensor-parallel size, or in another precision (bf16: this run's; bf16 runs write their ZeRO
    files under other names, which DeepSpeed does not look for in fp32, nor the other way), and
    resumes through a universal checkpoint (pretrain.universal); False
    when the layout is the saved one, or for a model with routed experts at another world size
    (loaded without a conversion, moments fresh). Refused with the reason and the fix: another ZeRO
    stage family (0, 1-2, 3: their files differ, and DeepSpeed loads none into another), for a model
    with routed experts another tensor-parallel size or precision, or ZeRO 0 / 3 (DeepSpeed's
    universal checkpoints do not take experts), a changed
    global batch (the schedule and the sample order are counted in steps of it), and a checkpoint
    whose marker predates layout records."""
    saved_world, saved_tp = meta.get("world_size"), meta.get("tensor_parallel")
    saved_family = saved_zero_family(meta, path)
    asked_family = zero_family(zero_stage) if zero_stage is not None else None
    stage_changed = None not in (saved_family, asked_family) and saved_family != asked_family
    if meta.get("optimizer_state") is False:  # weights only (tools.import_hf): they load at ZeRO 0-2
        stage_changed = stage_changed and "3" in (saved_family, asked_family)
    if stage_changed:  # DeepSpeed loads a checkpoint, universal ones too, in its own stage family only
        stages = {"0": "ZeRO-0", "1-2": "ZeRO-1 or 2", "3": "ZeRO-3"}[saved_family]
        raise CheckpointError(
            f"checkpoint {path} was saved at {stages}, this run asks for parallel.zero_stage={zero_stage}: its "
            f"files load at {stages} only (ZeRO-1 and 2 share theirs); resume it at the saved stage, or start a "
            f"new run.dir from its weights with train.init_from={path} (optimizer, schedule and data order start "
            "over)")
    saved_bf16 = meta.get("bf16")
    if saved_bf16 is None and saved_family in ("1-2", "3"):  # older markers: by the ZeRO files' names
        saved_bf16 = any(Path(path).glob("bf16_zero_pp_rank_*"))  # (ZeRO-0 keeps its state in one file)
    precision_changed = None not in (bf16, saved_bf16, saved_world) and bf16 != saved_bf16 \
        and meta.get("optimizer_state") is not False  # weights only load in either
    if not precision_changed and (saved_world is None or (saved_world == world_size and saved_tp in (None, tensor))):
        return False
    if meta.get("optimizer_state") is False and saved_tp in (None, tensor):
        return False  # weights only (tools.import_hf): they load at any data-parallel size, moments fresh
    precision = (lambda in_bf16: " in bf16" if in_bf16 else " in fp32") if precision_changed else (lambda _: "")
    saved = f"world {saved_world}" + (f" = tensor {saved_tp} x data {saved_world // saved_tp}" if saved_tp else "") \
        + precision(saved_bf16)
    asked = f"world {world_size} = tensor {tensor} x data {world_size // tensor}" + precision(bf16)
    keep = (f"resume it with the saved number of processes, parallel.tensor and train.precision, or start a new "
            f"run.dir from its weights with train.init_from={path} (optimizer, schedule and data order start over)")
    if saved_tp is None or meta.get("global_batch") is None:
        raise CheckpointError(f"checkpoint {path} was saved at {saved} and records no layout for a conversion; "
                              f"this run asks for {asked}: {keep}")
    if routed and (precision_changed or saved_tp != tensor or saved_family != "1-2"):
        raise CheckpointError(f"checkpoint {path} was saved at {saved}, this run asks for {asked}: a model with "
                              f"routed experts resumes at the saved tensor-parallel size and precision only, at "
                              f"ZeRO 1-2 (the world and expert-parallel sizes may change); {keep}")
    if not any(Path(path).glob("*optim_states.pt")):
        raise CheckpointError(f"checkpoint {path} was saved at {saved} without ZeRO optimizer shards "
                              f"(parallel.zero_stage=0), which a conversion to {asked} needs: {keep}")
    if meta["global_batch"] != global_batch:
        raise CheckpointError(
            f"checkpoint {path} was trained with a global batch of {meta['global_batch']} samples (at {saved}); "
            f"this run's is {global_batch} (train.micro_batch x train.grad_accum x data-parallel size at {asked}): "
            f"set them so that the product is {meta['global_batch']}, e.g. train.grad_accum, or {keep}")
    # Routed experts at another world size: DeepSpeed's universal checkpoints do not take them, but
    # their weights load at any data- and expert-parallel size (pretrain.checkpoint.load: the module
    # per tensor-parallel rank, each expert by its global id), with the schedule and the data
    # position; AdamW's moments start afresh.
    return not routed


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint tag directory from a tag directory or a run directory."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    if TAG_PATTERN.match(path.name) or any(path.glob("*_model_states.pt")):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker: the save was interrupted or is "
            "still running); point at a complete step_XXXXXXXX directory or at the run directory"
        )
    for ckpt_dir in (checkpoint_dir(path), path):
        if ckpt_dir.is_dir():
            found = latest_complete(ckpt_dir)
            if found is not None:
                return found
    raise CheckpointError(f"{path}: no complete checkpoint found (expected RUN_DIR/checkpoints/step_XXXXXXXX/"
                          f"{COMPLETE}, or a step_XXXXXXXX directory)")


def _expert_ids(keys) -> dict[str, set[int]]:
    """{layer prefix: the expert ids its keys name}."""
    ids: dict[str, set[int]] = {}
    for key in keys:
        if match := EXPERT_KEY.match(key):
            ids.setdefault(match.group(1), set()).add(int(match.group(2)))
    return ids


def global_expert_keys(keys, ep_rank: int, local_experts: int = 0) -> dict[str, str]:
    """A module's parameter names (local expert ids) -> the checkpoint's (global expert ids): rank r
    holds ids [r * local, (r + 1) * local), `local_experts` per rank, else as many as a layer's keys name."""
    local = _expert_ids(keys)
    out = {}
    for key in keys:
        match = EXPERT_KEY.match(key)
        count = local_experts or (len(local[match.group(1)]) if match else 0)
        out[key] = f"{match.group(1)}{ep_rank * count + int(match.group(2))}{match.group(3)}" if match else key
    return out


def local_expert_state(full: dict, ep_size: int, ep_rank: int) -> dict:
    """Keep one expert-parallel rank's experts (global ids [rank * N/ep, (rank + 1) * N/ep)) of a
    state dict with global expert ids, under their local ids; everything else as it is."""
    experts = _expert_ids(full)
    out = {}
    for key, value in full.items():
        match = EXPERT_KEY.match(key)
        if not match:
            out[key] = value
            continue
        n = len(experts[match.group(1)])
        if n % ep_size:
            raise ValueError(f"{match.group(1)}: {n} experts are not divisible by expert-parallel size {ep_size}")
        local = n // ep_size
        g = int(match.group(2))
        if ep_rank * local <= g < (ep_rank + 1) * local:
            out[f"{match.group(1)}{g - ep_rank * local}{match.group(3)}"] = value
    return out


def write_stop_marker(run_dir: str | os.PathLike, step: int, signal_name: str) -> Path:
    """Record that the run saved a complete checkpoint at `step` and stopped on a signal."""
    path = Path(run_dir) / STOP_MARKER
    atomic_write(path, (json.dumps({"step": step, "signal": signal_name, "time": time.time()}) + "\n").encode())
    return path


def _read_marker(path: Path) -> dict | None:
    """A JSON marker file, None where it is missing or unreadable (being replaced)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def read_stop_marker(run_dir: str | os.PathLike) -> dict | None:
    return _read_marker(Path(run_dir) / STOP_MARKER)


def clear_run_markers(run_dir: str | os.PathLike) -> None:
    """Remove what the previous start recorded of how it ended (a signal stop, a failure)."""
    (Path(run_dir) / STOP_MARKER).unlink(missing_ok=True)
    (Path(run_dir) / FAILURE_MARKER).unlink(missing_ok=True)


def write_failure_marker(run_dir: str | os.PathLike, rank: int, error: BaseException) -> None:
    """Record the error that ends this start on `rank`, unless a rank recorded one first (the others'
    are mostly its consequences: a peer gone from a collective)."""
    record = {"rank": rank, "error": f"{type(error).__name__}: {str(error).strip()[:2000]}", "time": time.time()}
    try:
        with open(Path(run_dir) / FAILURE_MARKER, "x") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:  # recorded already, or the run directory is not there
        pass


def read_failure_marker(run_dir: str | os.PathLike) -> dict | None:
    return _read_marker(Path(run_dir) / FAILURE_MARKER)
