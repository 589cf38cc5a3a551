"""A training checkpoint -> one full, single-process state dict, for any saved layout.

    from pretrain.consolidate import load_model, full_state_dict
    model, cfg, meta = load_model("runs/x/checkpoints/step_00001000")   # GPT at TP=1, fp32, eval mode
    state, cfg, meta = full_state_dict("runs/x")                        # newest complete checkpoint

`python -m tools.consolidate` writes such a state dict to a file.

Layouts read (DeepSpeed files in RUN_DIR/checkpoints/step_XXXXXXXX/):

* ZeRO 0/1/2: `mp_rank_{TP:02d}_model_states.pt` holds the whole 'module' of tensor-parallel rank TP;
  a bf16 run's fp32 masters at ZeRO 1-2 come from `bf16_zero_pp_rank_{DP}_mp_rank_{TP:02d}_optim_states.pt`
  (fp32_masters).
* ZeRO-3: parameters are partitioned over the data-parallel group; the fp32 master weights are
  rebuilt from `zero_pp_rank_{DP}_mp_rank_{TP:02d}_{model,optim}_states.pt` with DeepSpeed's
  zero_to_fp32 helpers, one tensor-parallel rank at a time.
* Expert weights (MoE / UoE) saved as `layer_{L}_expert_{E}_mp_rank_{TP:02d}_model_states.pt`
  are added under their global expert id (pretrain.checkpoint_format.EXPERT_KEY).

Tensor-parallel shards are then concatenated along each parameter's `partition_dim`, read from a
model built at tensor-parallel size 1 (megatron-core marks every split parameter with
`tensor_model_parallel` and `partition_dim`, also at size 1), so any module built from
megatron-core parallel layers (any attention kind) merges without code here;
parameters not marked (norms, routers, DeepSpeed expert weights) are compared with their full
shape: a shard that is whole is taken from rank 0, one smaller by the tensor-parallel size along
exactly one dimension is concatenated along it (contiguous splits). The result
is keyed exactly like `GPT(cfg).state_dict()` at TP=1 and EP=1.

Every file the layout needs is checked before anything is read, so a partial checkpoint (no
COMPLETE marker) or one missing a rank's files fails with a message naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from models.config import ModelConfig
from pretrain.checkpoint_format import (
    COMPLETE,
    EXPERT_KEY,
    MP_MODEL,
    ZERO3_MODEL,
    CheckpointError,
    global_expert_keys,
    read_meta,
    resolve_checkpoint,
)


class ConsolidateError(CheckpointError):
    """The checkpoint's files cannot be read as asked; the message says what is wrong and what to do."""


def run_config(tag_dir: Path):
    """The resolved run config saved next to the checkpoints (RUN_DIR/config.yaml), or None.
    Sections another entry point adds to its config (posttrain's `post`) are left out."""
    from pretrain.config import load_config

    path = tag_dir.parent.parent / "config.yaml"
    return load_config(path, known_sections_only=True) if path.is_file() else None


def expert_files(model: dict, tensor: int) -> set[str]:
    """The expert files DeepSpeed writes for a model: one per routed layer (numbered among the routed
    layers), expert (global id) and tensor-parallel rank, whatever the expert-parallel size."""
    from models import registry

    cfg = ModelConfig.from_dict(model)
    routed = sum(registry.mlp_kind(cfg.mlp_kind(layer)).routed for layer in range(cfg.num_layers))
    return {f"layer_{layer}_expert_{expert}_mp_rank_{t:02d}_model_states.pt"
            for layer in range(routed) for expert in range(cfg.moe.num_experts) for t in range(tensor)}


def describe_layout(tag_dir: Path, meta: dict, with_optimizer: bool = False) -> dict:
    """{"tensor", "data", "zero3", "experts"} read from the file names and the marker; raises
    ConsolidateError naming every file a complete checkpoint of that layout would have but this lacks
    (`with_optimizer`: a resume's too, ZeRO 1-2's optimizer partitions)."""
    names = {p.name for p in tag_dir.iterdir()}
    zero3 = sorted((int(m.group(1)), int(m.group(2))) for n in names if (m := ZERO3_MODEL.match(n)))
    mp = sorted(int(m.group(1)) for n in names if (m := MP_MODEL.match(n)))
    world = int(meta.get("world_size", 1))
    # The size the checkpoint was saved at: its marker's (config.yaml follows the latest start of the
    # run, perhaps at another layout); markers written before it was recorded: config.yaml, else the
    # highest tensor-parallel rank any file is named after.
    cfg = run_config(tag_dir) if "tensor_parallel" not in meta else None
    named = [int(m.group(1)) for n in names if (m := re.search(r"mp_rank_(\d+)_", n))]
    tensor = int(meta["tensor_parallel"]) if "tensor_parallel" in meta else \
        cfg.parallel.tensor if cfg is not None else max(named + [0]) + 1
    if world % tensor:
        raise ConsolidateError(f"{tag_dir}: world size {world} in {COMPLETE} is not divisible by tensor-parallel "
                               f"size {tensor}")
    data = world // tensor
    missing = [f"rank_{r:05d}.pt" for r in range(world) if f"rank_{r:05d}.pt" not in names]
    if zero3:
        for d in range(data):
            for t in range(tensor):
                model_file = f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt"
                if model_file not in names:
                    missing.append(model_file)
                if not any(n.endswith(f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt") for n in names):
                    missing.append(f"[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")
    else:
        missing += [f"mp_rank_{t:02d}_model_states.pt" for t in range(tensor) if t not in mp]
        if with_optimizer and meta.get("zero_stage") in (1, 2) and meta.get("optimizer_state", True):
            missing += [f"[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(data)
                        for t in range(tensor)
                        if not any(n.endswith(f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt") for n in names)]
    # Every expert file the model needs, also where a copy lost them all (markers without the model
    # are refused by every reader)
    expected = expert_files(meta["model"], tensor) if "model" in meta else set()
    missing += sorted(expected - names)
    if missing:
        raise ConsolidateError(
            f"checkpoint {tag_dir} (world size {world} = tensor {tensor} x data {data}, "
            f"{'ZeRO-3' if zero3 else 'ZeRO 0-2'}) is missing {len(missing)} file(s): {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; copy the whole checkpoint directory or use another step"
        )
    # Experts each expert-parallel rank holds (0: unknown, markers before the size was recorded).
    local = ModelConfig.from_dict(meta["model"]).moe.num_experts // int(meta["expert_parallel"]) \
        if expected and "expert_parallel" in meta else 0
    return {"tensor": tensor, "data": data, "zero3": bool(zero3), "experts": bool(expected), "local_experts": local}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _zero3_state(tag_dir: Path, mp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 weights of one tensor-parallel rank from its data-parallel ZeRO-3 partitions."""
    from deepspeed.utils import zero_to_fp32

    suffix = f"mp_rank_{mp_rank:02d}_"
    with tempfile.TemporaryDirectory(prefix="consolidate-") as tmp:
        for f in tag_dir.iterdir():
            if f.name.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) and suffix in f.name:
                os.symlink(f.resolve(), Path(tmp) / f.name)
        with contextlib.redirect_stdout(sys.stderr):
            state = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint(tmp, exclude_frozen_parameters=False)
            # Lazy views over the flat partitions: materialise while the files are reachable.
            return {k: v.contiguous() if hasattr(v, "contiguous") else v for k, v in state.items()}


def fp32_masters(tag_dir: Path, mp_rank: int, data: int, local_experts: int = 0) -> dict[str, torch.Tensor] | None:
    """The fp32 master weights of one tensor-parallel rank of a bf16 run at ZeRO 1-2, flat, joined
    from its data-parallel optimizer partitions (DeepSpeed's param_slice_mappings give each
    parameter's fragment in each partition, in rank order); None where the files hold none.

    Routed experts (local_experts per expert-parallel rank; 0: their masters are not read) are in
    groups of their own, partitioned over the expert-data-parallel ranks and named by local id:
    data-parallel rank d holds expert-parallel rank d % E's experts, whose partitions follow in
    the order of d (the layout megatron-core and DeepSpeed's groups share; with_masters checks that
    every master rounds to its saved weight)."""
    files = [tag_dir / f"bf16_zero_pp_rank_{d}_mp_rank_{mp_rank:02d}_optim_states.pt" for d in range(data)]
    if not all(f.is_file() for f in files):
        return None
    pieces: dict[str, list[torch.Tensor]] = {}
    for d, f in enumerate(files):  # one at a time, mapped: only the fp32 partitions are read, not the Adam moments
        state = torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
        if "param_slice_mappings" not in state:
            return None
        groups = state["base_optimizer_state"]["param_groups"]
        for flat, mapping, group, count in zip(state["single_partition_of_fp32_groups"], state["param_slice_mappings"],
                                               groups, state["partition_count"]):
            names = {name: name for name in mapping}
            if group.get("moe"):
                if not local_experts:
                    continue
                # expert-parallel rank d % E, E = data / expert-data-parallel size
                names = global_expert_keys(mapping, d % (data // count), local_experts)
            for name, fragment in mapping.items():
                pieces.setdefault(names[name], []).append(flat.narrow(0, fragment.start, fragment.numel).clone())
    return {name: torch.cat(parts) for name, parts in pieces.items()}


def with_masters(module: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], where: Path
                 ) -> dict[str, torch.Tensor]:
    """The module's bf16 weights replaced by their fp32 masters (keys sharing a tensor, as tied
    embeddings do, by the same one), each checked to round to the weight it replaces."""
    by_storage = {module[name].untyped_storage().data_ptr(): name for name in masters if name in module}
    state = dict(module)
    for key, value in module.items():
        name = key if key in masters else by_storage.get(value.untyped_storage().data_ptr()) \
            if torch.is_tensor(value) else None
        if name is None:
            continue
        master = masters[name]
        if master.numel() != value.numel() or not torch.equal(master.to(value.dtype), value.flatten()):
            raise ConsolidateError(f"{where}: the fp32 master of {key} does not round to its saved weight; the "
                                   "optimizer partitions and the model file are of different saves")
        state[key] = master.view(value.shape)
    return state


def rank_state(tag_dir: Path, mp_rank: int, layout: dict) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's state dict as saved (ZeRO-3 partitions joined, experts under global ids):
    the fp32 weights, of a bf16 run too (its fp32 masters: ZeRO-3's partitions; at ZeRO 1-2 those
    of its optimizer partitions, routed experts' too where the marker records the expert-parallel
    size), except where a bf16 run saved no fp32 masters beside its weights (ZeRO-0, whose optimizer
    keeps them in the model file): the bf16 weights."""
    state = _zero3_state(tag_dir, mp_rank) if layout["zero3"] else \
        dict(_load(tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")["module"])
    if layout["experts"]:
        state = {k: v for k, v in state.items() if not EXPERT_KEY.match(k)}
        for f in sorted(tag_dir.glob(f"layer_*_expert_*_mp_rank_{mp_rank:02d}_model_states.pt")):
            state.update(_load(f))  # keys carry the global expert id
    if not layout["zero3"]:
        masters = fp32_masters(tag_dir, mp_rank, layout["data"], layout.get("local_experts", 0))
        if masters is not None:
            state = with_masters(state, masters, tag_dir)
    return state


def partition_dims(model: torch.nn.Module) -> dict[str, int | None]:
    """name -> the dimension tensor parallelism splits (None: not marked, see merge_tensor_parallel)."""
    return {name: (int(p.partition_dim) if getattr(p, "tensor_model_parallel", False)
                   and getattr(p, "partition_dim", None) is not None else None)
            for name, p in model.named_parameters()}


def _split_dim(name: str, shard: torch.Tensor, full: torch.Size, tp: int) -> int | None:
    """For a parameter megatron-core did not mark (e.g. expert weights): the one dimension whose
    shard size times the tensor-parallel size is the full size; None when the shard is whole."""
    if tuple(shard.shape) == tuple(full):
        return None
    dims = [d for d in range(shard.dim()) if shard.shape[d] * tp == full[d] and shard.shape[d] != full[d]]
    same = all(shard.shape[d] == full[d] for d in range(shard.dim()) if d not in dims)
    if len(dims) != 1 or not same or shard.dim() != len(full):
        raise ConsolidateError(f"{name}: cannot tell how a tensor-parallel shard {tuple(shard.shape)} makes up the "
                               f"full shape {tuple(full)} at tensor-parallel size {tp}")
    return dims[0]


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]], dims: dict[str, int | None],
                          full_shapes: dict[str, torch.Size] | None = None) -> dict:
    """Concatenate each split parameter's shards along its partition dim (marked by megatron-core,
    else inferred from the full shape); whole tensors come from rank 0."""
    if len(shards) == 1:
        return dict(shards[0])
    full_shapes = full_shapes or {}
    merged = {}
    for name, value in shards[0].items():
        if not torch.is_tensor(value):
            merged[name] = value
            continue
        dim = dims.get(name)
        if dim is None and name in full_shapes:
            dim = _split_dim(name, value, full_shapes[name], len(shards))
        if dim is None:
            merged[name] = value
            continue
        missing = [r for r, s in enumerate(shards) if name not in s]
        if missing:
            raise ConsolidateError(f"tensor-parallel rank(s) {missing} hold no {name}; the checkpoint is inconsistent")
        merged[name] = torch.cat([s[name] for s in shards], dim=dim)
    return merged


def _single_process() -> None:
    from pretrain.distributed import init_single_process

    try:
        init_single_process()
    except RuntimeError as err:
        raise ConsolidateError(str(err)) from err


def as_float32(state: dict) -> dict:
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in state.items()}


def tensor_parallel_shards(tag_dir: Path, layout: dict) -> list[dict[str, torch.Tensor]]:
    """One fp32 state dict per tensor-parallel rank (experts under their global ids)."""
    return [as_float32(rank_state(tag_dir, t, layout)) for t in range(layout["tensor"])]


def full_state_dict(checkpoint: str | os.PathLike, model: torch.nn.Module | None = None):
    """(full fp32 state dict keyed like GPT(cfg) at TP=1, ModelConfig, marker meta).

    `model`: a GPT of this config built at TP=1 (built here, and discarded, when not given)."""
    tag_dir = resolve_checkpoint(checkpoint)
    meta = read_meta(tag_dir)
    if "model" not in meta:
        raise ConsolidateError(f"{tag_dir / COMPLETE} has no 'model' entry; it was not written by pretrain.train")
    cfg = ModelConfig.from_dict(meta["model"])
    layout = describe_layout(tag_dir, meta)
    if model is None:
        from models.gpt import GPT

        _single_process()
        model = GPT(cfg)
    shards = tensor_parallel_shards(tag_dir, layout)
    full_shapes = {k: v.shape for k, v in model.state_dict().items() if torch.is_tensor(v)}
    state = merge_tensor_parallel(shards, partition_dims(model), full_shapes)
    meta = {**meta, "layout": layout, "checkpoint": str(tag_dir)}
    return state, cfg, meta


def split_heads(state: dict, heads: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Take the heads a post-training run added beside the LM (meta["heads"], e.g. SGA's
    value_head) out of a full state dict: {head: its own state dict}."""
    return {name: {k[len(name) + 1:]: state.pop(k) for k in list(state) if k.startswith(name + ".")}
            for name in heads}


def load_model(checkpoint: str | os.PathLike):
    """(GPT at TP=1 in fp32 with the checkpoint's weights, eval mode; ModelConfig; meta).
    meta["head_states"]: {head name: its state dict} for the heads meta["heads"] names."""
    from models.gpt import GPT

    tag_dir = resolve_checkpoint(checkpoint)
    cfg = ModelConfig.from_dict(read_meta(tag_dir)["model"])
    _single_process()
    model = GPT(cfg)
    state, cfg, meta = full_state_dict(tag_dir, model)
    own = model.state_dict()
    for key in own:  # megatron-core's per-layer extra state (None); ZeRO-3 reconstruction omits it
        if key.endswith("_extra_state"):
            state.setdefault(key, own[key])
    meta["head_states"] = split_heads(state, meta.get("heads", []))
    unexpected = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unexpected or missing:
        raise ConsolidateError(f"checkpoint {tag_dir} does not match model {cfg.mlp}/{cfg.attention}: "
                               f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    bad = [k for k in own if torch.is_tensor(own[k]) and (not torch.is_tensor(state[k]) or own[k].shape != state[k].shape)]
    if bad:
        raise ConsolidateError(f"checkpoint {tag_dir}: shapes differ from the model for {bad[:6]} "
                               f"(e.g. {bad[0]}: {tuple(state[bad[0]].shape)} vs {tuple(own[bad[0]].shape)})")
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg, meta
