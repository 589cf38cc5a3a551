"""Start a new run from the weights of a checkpoint saved at any layout.

    python -m pretrain.train --config cfg.yaml train.init_from=runs/base/checkpoints/step_00010000

The source may be any complete checkpoint of the same model (a run directory means its newest
complete one): any tensor / expert / data-parallel size and ZeRO stage, or one written by
tools.import_hf or tools.convert_lisa; or a file of full weights {"model": ..., "state_dict": ...} such as
tools.consolidate writes. Every rank reads the source's tensor-parallel shards,
merges them into full tensors (pretrain.consolidate) and keeps its own slice for the run's
layout, before DeepSpeed builds the engine (so ZeRO-3 partitions the loaded weights). The optimizer, learning-rate
schedule and data order start fresh at step 0. A run that has its own checkpoints resumes from
them instead (train.resume=auto), so a requeued job does not start over.

Memory: each rank holds the full fp32 weights once while loading (12 GB for a 3B model).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from pretrain.checkpoint import check_compatible
from pretrain.checkpoint_format import (
    COMPLETE,
    CheckpointError,
    global_expert_keys,
    read_meta,
    resolve_checkpoint,
)
from pretrain.consolidate import as_float32, describe_layout, merge_tensor_parallel, tensor_parallel_shards


def state_file(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(state, dict) or not {"model", "state_dict"} <= set(state):
        raise CheckpointError(f"train.init_from={path}: a file must hold {{'model': ..., 'state_dict': ...}} "
                              "(as tools.consolidate writes); for a training checkpoint give its directory")
    return state


INIT_FIX = "point train.init_from at a checkpoint of this model, or set model.* to the checkpoint's"
# The weights do not depend on the positions RoPE is built for: a new run may train at another
# sequence length (e.g. a longer context) from them.
MAY_DIFFER = ("max_seq_len",)


def check_source(path: str, model: dict, tokenizer_sha256: str | None) -> Path:
    """The source (tag directory or state file), checked (same model, tokenizer, every file
    present) before any process group or model exists."""
    if Path(path).is_file():  # tools.consolidate records the run's tokenizer (older files: none)
        state = state_file(Path(path))
        check_compatible({"model": state["model"], "tokenizer_sha256": state.get("tokenizer_sha256")}, model,
                         tokenizer_sha256, Path(path), INIT_FIX, MAY_DIFFER)
        return Path(path)
    try:
        tag = resolve_checkpoint(path)
        meta = read_meta(tag)
        describe_layout(tag, meta)
    except CheckpointError as err:
        raise CheckpointError(f"train.init_from={path}: {err}") from None
    check_compatible(meta, model, tokenizer_sha256, tag, INIT_FIX, MAY_DIFFER)
    return tag


SAMPLE_BYTES = 1 << 20


def source_fingerprint(path: Path) -> str:
    """What tells a source's weights from others written at the same path later, and not from a
    copy of them put back: a checkpoint's COMPLETE marker (its step, time and layout), a weights
    file's size and three MiB of its bytes (start, middle, end: other weights differ in all of them)."""
    path = Path(path)
    if path.is_dir():
        return hashlib.sha256((path / COMPLETE).read_bytes()).hexdigest()[:16]
    digest, size = hashlib.sha256(str(path.stat().st_size).encode()), path.stat().st_size
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _full_shape(param: torch.Tensor, tp: int) -> torch.Size:
    dim = getattr(param, "partition_dim", None)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False) or dim is None:
        return param.shape
    shape = list(param.shape)
    shape[dim] *= tp
    return torch.Size(shape)


@torch.no_grad()
def load_weights(model: torch.nn.Module, tag: Path, optional: tuple[str, ...] = ()) -> None:
    """Copy the source's weights into this rank's (tensor- and expert-parallel) part of `model`.
    `optional`: key prefixes (heads a post-training run adds) loaded when the source has them and
    otherwise left as initialised."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    own = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    params = dict(model.named_parameters())
    names = global_expert_keys(own, ps.get_expert_model_parallel_rank())
    full_shapes = {names[k]: _full_shape(params.get(k, v), tp) for k, v in own.items()}
    dims = {names[k]: (int(p.partition_dim) if getattr(p, "tensor_model_parallel", False)
                       and getattr(p, "partition_dim", None) is not None else None) for k, p in params.items()}
    if tag.is_file():  # full TP=1 weights (tools.consolidate, tools.convert_lisa)
        full = as_float32(state_file(tag)["state_dict"])
    else:
        layout = describe_layout(tag, read_meta(tag))
        full = merge_tensor_parallel(tensor_parallel_shards(tag, layout), dims, full_shapes)
    missing = sorted(n for n in full_shapes if n not in full and not n.startswith(optional or (" ",)))
    if missing:
        raise CheckpointError(f"train.init_from={tag}: the checkpoint lacks {missing[:6]}")
    for key, local in own.items():
        if names[key] not in full:  # an optional head the source does not have
            continue
        source = full[names[key]]
        want = full_shapes[names[key]]
        if tuple(source.shape) != tuple(want):
            raise CheckpointError(f"train.init_from={tag}: {names[key]} is {tuple(source.shape)}, this model needs "
                                  f"{tuple(want)}")
        if tuple(want) != tuple(local.shape):  # split over tensor-parallel ranks: keep this rank's slice
            dim = next(d for d in range(local.dim()) if local.shape[d] != want[d])
            source = source.narrow(dim, tp_rank * local.shape[dim], local.shape[dim])
        local.copy_(source.to(local.dtype))
