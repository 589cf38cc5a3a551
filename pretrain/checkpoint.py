"""Checkpoints: DeepSpeed's sharded model/optimizer files plus, per rank, the data-loader and
RNG state; a COMPLETE marker written after every rank finished; `latest` moved last.

A crash at any point leaves `latest` at the previous complete checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from models.config import ModelConfig
from pretrain.checkpoint_format import (
    COMPLETE,
    LATEST,
    TAG_PATTERN,
    CheckpointError,
    atomic_write,
    latest_complete,
    read_meta,
    record_save_job,
    tag_for,
)
from pretrain.universal import FOREIGN


def torch_save_atomic(obj, path: Path) -> None:
    """torch.save to `path` whole or not at all (a temporary file beside it, renamed over it): an
    interrupted save leaves no file that looks valid."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # what a failed save or rename leaves


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, ckpt_dir: Path, step: int, meta: dict, rank_state: dict, keep_last: int, keep_every: int = 0) -> Path:
    """Collective: every rank calls it at the same step. Afterwards the last `keep_last` complete
    checkpoints stay, and those of steps that are multiples of `keep_every` (0: none)."""
    tag = tag_for(step)
    rank = dist.get_rank()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0 and (ckpt_dir / tag).exists():
        # An earlier save of this step (crashed, maybe at another world size): none of its files may
        # mix with this one's, and its COMPLETE must not vouch for a half-rewritten directory (the
        # marker goes first: a kill during the removal leaves no complete-looking remainder).
        remove_checkpoint(ckpt_dir / tag, ignore_errors=False)
    dist.barrier()
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    from pretrain.universal import checkpoint_info

    client_state = {"step": step}
    if not engine.has_moe_layers:  # DeepSpeed's MoE save writes this key itself (and takes no conversion)
        client_state[UNIVERSAL_CHECKPOINT_INFO] = checkpoint_info(engine.module)
    path = ckpt_dir / tag
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False, client_state=client_state)
        atomic_write(path / f"rank_{rank:05d}.pt", _torch_bytes({"rng": rng_state(), **rank_state}))
    except (OSError, RuntimeError) as err:
        if not storage_error(err):  # a peer lost in the save's collectives, out of memory: as they are
            raise
        raise CheckpointError(save_failure(ckpt_dir, tag, err)) from err
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt_dir / "universal" / tag, ignore_errors=True)  # a conversion of an older save of this tag
        marker = {**meta, "step": step, "world_size": dist.get_world_size(), "time": time.time(),
                  "expert_parallel": _expert_parallel_size(), "tensor_parallel": _tensor_parallel_size(),
                  "zero_stage": engine.zero_optimization_stage()}
        atomic_write(path / COMPLETE, json.dumps(marker, indent=1).encode())
        atomic_write(ckpt_dir / LATEST, tag.encode())
        record_save_job(ckpt_dir.parent)
        _prune(ckpt_dir, keep_last, keep=tag, keep_every=keep_every)
    dist.barrier()
    return path


# torch.save's writer reports a write the file system refused as a RuntimeError with these words
TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def storage_error(err: Exception) -> bool:
    """Whether a save failed because the file system refused a write."""
    if isinstance(err, OSError):
        return True
    return type(err) is RuntimeError and any(words in str(err) for words in TORCH_WRITE_FAILURES)


def save_failure(ckpt_dir: Path, tag: str, err: Exception) -> str:
    """What a failed save tells the user: the error, the room left, and which checkpoint is intact."""
    free = shutil.disk_usage(ckpt_dir).free / 2**30
    latest = latest_complete(ckpt_dir)
    last = f"; the last one took {size_gb(latest):.1f} GB" if latest is not None else ""
    return (f"saving checkpoint {ckpt_dir / tag} failed ({type(err).__name__}: {str(err).strip()[:300]}); "
            f"{free:.1f} GB are free on its file system{last}. "
            + (f"The newest complete checkpoint, {latest}, is intact (the unfinished {tag} is never resumed): "
               if latest is not None else f"No complete checkpoint exists yet (the unfinished {tag} is never "
                                          "resumed): ")
            + ("free space there, or lower train.keep_last, and run the job again" if full(err) else
               "make the checkpoint directory writable, and run the job again"))


def full(err: Exception) -> bool:
    """Whether a refused write means no room: a full disk, a quota, a file-size limit (torch.save's
    own errors name no cause, and are mostly that)."""
    return not isinstance(err, OSError) or err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def size_gb(tag_dir: Path) -> float:
    """A checkpoint's size on disk."""
    return sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file()) / 2**30


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def remove_checkpoint(tag_dir: Path, ignore_errors: bool = True) -> None:
    """Delete a checkpoint directory, its COMPLETE marker first: interrupted, what is left is a
    partial checkpoint, which resume refuses and the next save clears."""
    (tag_dir / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=ignore_errors)


def _prune(ckpt_dir: Path, keep_last: int, keep: str, keep_every: int = 0) -> None:
    complete = sorted(d.name for d in ckpt_dir.iterdir() if TAG_PATTERN.match(d.name) and (d / COMPLETE).exists())
    for name in complete[:-keep_last]:
        if name != keep and not (keep_every and int(TAG_PATTERN.match(name).group(1)) % keep_every == 0):
            remove_checkpoint(ckpt_dir / name)
            shutil.rmtree(ckpt_dir / "universal" / name, ignore_errors=True)  # its cached conversion
    # Conversions of another run's checkpoint this run resumed: it has one of its own now.
    for converted in (ckpt_dir / "universal").glob(f"*{FOREIGN}*"):
        shutil.rmtree(converted, ignore_errors=True)
    # Partial checkpoints older than the newest complete one are leftovers of crashed saves.
    for d in ckpt_dir.iterdir():
        if TAG_PATTERN.match(d.name) and not (d / COMPLETE).exists() and d.name < keep:
            shutil.rmtree(d, ignore_errors=True)


RESUME_FIX = "point train.resume at a checkpoint of this model, use a new run.dir, or set train.resume=none"


def check_compatible(meta: dict, model_config_dict: dict, tokenizer_sha256: str | None, path: Path,
                     fix: str = RESUME_FIX, ignore: tuple[str, ...] = ()) -> None:
    """The checkpoint's model is the config's. Keys and sections the marker lacks (added since it was
    written, or declared by a plug-in only one side lists) count at their defaults. `fix`: what the
    error tells the user to do; `ignore`: keys that may differ."""
    plugins = sorted({*meta["model"].get("plugins", []), *model_config_dict.get("plugins", [])})
    saved = ModelConfig.from_dict({**meta["model"], "plugins": plugins}).signature()
    wanted = ModelConfig.from_dict({**model_config_dict, "plugins": plugins}).signature()
    diff = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k) and k not in ignore)
    if diff:
        details = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {wanted.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {path} belongs to another model ({details}); {fix}"
        )
    if tokenizer_sha256 and meta.get("tokenizer_sha256") and meta["tokenizer_sha256"] != tokenizer_sha256:
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]} "
            f"vs {tokenizer_sha256[:12]}); use the tokenizer of that run"
        )


def _tensor_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _expert_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


GROUP_SETTINGS = ("name", "weight_decay", "betas", "eps")  # a group's settings, from the config


def restores_optimizer(meta: dict) -> bool:
    """Whether resuming this checkpoint (not through a universal one) restores its optimizer moments:
    ZeRO's partitions are laid out per expert-parallel size, and weights written without training
    (optimizer_state false: tools.import_hf) have none."""
    return (meta.get("expert_parallel", 1) == _expert_parallel_size() and meta.get("optimizer_state", True)
            and meta.get("world_size", dist.get_world_size()) == dist.get_world_size())


def load(engine, path: Path, universal: Path | None = None) -> dict:
    """Restore model, optimizer and schedule; return this rank's saved state (loader, RNG).

    Experts are stored one file per global expert id, so their weights load at any expert-parallel
    size; ZeRO optimizer shards are laid out per EP size, so after an EP change the optimizer
    restarts from the loaded weights (moments reset) while the LR schedule is restored.
    ``universal``: the universal form of ``path`` (pretrain.universal), for another DP / TP size."""
    meta = read_meta(path)
    # The optimizer state carries its groups' settings as saved (and ZeRO-3 puts a universal
    # checkpoint's first group's into every group, so the norms would decay): each group keeps
    # what this run's config gives it, as the rate below.
    settings = [{k: g[k] for k in GROUP_SETTINGS if k in g} for g in engine.optimizer.param_groups]
    if universal is not None:
        engine.load_checkpoint(str(universal.parent), tag=universal.name, load_module_strict=True,
                               load_optimizer_states=True)
    else:
        with_optimizer = restores_optimizer(meta)
        engine.load_checkpoint(str(path.parent), tag=path.name, load_module_strict=True,
                               load_optimizer_states=with_optimizer)
        refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
        if not with_optimizer and refresh is not None:
            refresh()  # ZeRO-0's bf16 optimizer keeps fp32 masters, else its first step restores the init
    for group, own in zip(engine.optimizer.param_groups, settings, strict=True):
        group.update(own)
    engine.lr_scheduler.follow_config()  # after the optimizer state, which carries the saved rate
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if not rank_file.is_file():  # another world size: fall back to rank 0's data state
        rank_file = path / "rank_00000.pt"
    state = torch.load(rank_file, weights_only=False)
    if rank_file.name == f"rank_{dist.get_rank():05d}.pt":
        set_rng_state(state["rng"])
    return state


def save_weights_run(model: torch.nn.Module, cfg, out: Path, meta: dict) -> Path:
    """A new run directory holding `model`'s weights as its step-0 checkpoint (one process, TP=1),
    written through a real DeepSpeed engine, with `cfg` as RUN_DIR/config.yaml. The marker says there
    is no optimizer state (optimizer_state: false), so a resume keeps the weights and starts the
    optimizer fresh; train.init_from reads it at any layout. Written beside `out` and renamed into
    place, so `out` is whole or absent. Returns the checkpoint's tag directory."""
    from models.counting import flops_per_token, param_counts
    from pretrain.checkpoint_format import checkpoint_dir
    from pretrain.config import save_config
    from pretrain.engine import build_engine

    cfg = copy.deepcopy(cfg)  # the layout of the checkpoint it writes: one process, TP=1, ZeRO-1, fp32
    cfg.parallel.tensor, cfg.parallel.expert, cfg.parallel.zero_stage = 1, 1, 1
    cfg.train.precision = "fp32"
    with directory_in_place(Path(out)) as tmp:
        engine = build_engine(cfg, model)
        meta = {"model": cfg.to_dict()["model"], "flops_per_token": flops_per_token(cfg.model),
                "params": param_counts(cfg.model), **meta}
        rank_state = {"data": {"epoch": 0, "sample_in_epoch": 0, "shuffle_seed": cfg.data.shuffle_seed,
                               "num_canonical_nodes": cfg.data.num_canonical_nodes, "initial_physical_nodes": 1},
                      "tokens_seen": 0}
        save(engine, checkpoint_dir(tmp), 0, meta, rank_state, keep_last=1)
        tag = tmp / "checkpoints" / tag_for(0)
        marker = read_meta(tag)
        # No optimizer moments to restore: load() then keeps the loaded weights and schedule and
        # starts the optimizer fresh, at any data-parallel size and ZeRO stage 0-2.
        marker["optimizer_state"] = False
        (tag / COMPLETE).write_text(json.dumps(marker, indent=1))
        save_config(cfg, tmp / "config.yaml")
    return Path(out) / "checkpoints" / tag_for(0)


def readable_as_umask_says(root: Path) -> None:
    """The modes a plain mkdir / open would have given `root` and what is in it: mkdtemp makes 0700
    and safetensors writes 0600, so an export on a shared file system would be its owner's alone."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def directory_in_place(out: Path):
    """A new directory beside `out` to write into; it replaces `out` when the block ends without an
    error and is removed otherwise, so `out` is never left half written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        yield tmp
        readable_as_umask_says(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
