"""Expert-parallel layouts of checkpoints.

DeepSpeed writes the routed experts of every sparse layer as one file per global expert,
`layer_{L}_expert_{E}_mp_rank_{TP:02d}_model_states.pt`, and everything else (attention, norms,
VSE, router, shared expert, selection bias) in `mp_rank_{TP:02d}_model_states.pt`; only the ZeRO
optimizer shards depend on the expert-parallel size. `pretrain.checkpoint.load` therefore resumes
a checkpoint at another EP size directly (weights and LR schedule restored, optimizer moments
restarted); this module converts between the DeepSpeed layout and one plain, EP-independent
state dict with experts in global, expert-major order:

    python -m models.moe.convert_experts RUN_DIR[/checkpoints/step_00000100] model_tp00.pt [--mp-rank 0]

`local_state_dict(full, ep_size, ep_rank)` renumbers such a state dict for one EP rank, and
`load_full_state_dict(model, full)` loads it into a model built at any EP size.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

EXPERT_KEY = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


def consolidate(tag_dir: str | Path, mp_rank: int = 0) -> dict[str, torch.Tensor]:
    """One TP rank's full model state dict from a checkpoint tag (or run) directory, checked
    complete first; experts under their global ids, dtypes as saved."""
    from pretrain.checkpoint import read_meta
    from pretrain.consolidate import describe_layout, rank_state, resolve_checkpoint

    tag_dir = resolve_checkpoint(tag_dir)
    layout = describe_layout(tag_dir, read_meta(tag_dir))
    if not layout["experts"]:
        raise FileNotFoundError(f"{tag_dir}: no expert files; this checkpoint has no MoE/UoE layers")
    state = rank_state(tag_dir, mp_rank, layout)
    return dict(sorted(state.items(), key=lambda kv: _order(kv[0])))


def _order(key: str):
    m = EXPERT_KEY.match(key)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else (key, -1, "")


def local_state_dict(full: dict[str, torch.Tensor], ep_size: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """Keep this EP rank's experts (global ids [rank * N/ep, (rank + 1) * N/ep)) under local ids."""
    experts: dict[str, set[int]] = {}
    for key in full:
        m = EXPERT_KEY.match(key)
        if m:
            experts.setdefault(m.group(1), set()).add(int(m.group(2)))
    out = {}
    for key, value in full.items():
        m = EXPERT_KEY.match(key)
        if not m:
            out[key] = value
            continue
        n = len(experts[m.group(1)])
        if n % ep_size:
            raise ValueError(f"{m.group(1)}: {n} experts are not divisible by expert-parallel size {ep_size}")
        local = n // ep_size
        g = int(m.group(2))
        if ep_rank * local <= g < (ep_rank + 1) * local:
            out[f"{m.group(1)}{g - ep_rank * local}{m.group(3)}"] = value
    return out


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load an EP-independent state dict into a model built at megatron-core's current EP size."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
    model.load_state_dict(local_state_dict(full, ep, rank), strict=True)


def main(argv: list[str] | None = None) -> int:
    from pretrain.consolidate import ConsolidateError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint tag directory, e.g. runs/x/checkpoints/step_00000100")
    parser.add_argument("out", help="output .pt file (one per TP rank)")
    parser.add_argument("--mp-rank", type=int, default=0, help="tensor-parallel rank to convert")
    args = parser.parse_args(argv)
    try:
        state = consolidate(args.checkpoint, args.mp_rank)
    except (ConsolidateError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.save(state, args.out)
    n = sum(1 for k in state if EXPERT_KEY.match(k))
    print(f"wrote {args.out}: {len(state)} tensors, {n} of them expert weights (global expert-major order)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
