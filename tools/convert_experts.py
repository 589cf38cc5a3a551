"""Expert-parallel layouts of checkpoints.

DeepSpeed writes the routed experts of every sparse layer as one file per global expert,
`layer_{L}_expert_{E}_mp_rank_{TP:02d}_model_states.pt`, and everything else (attention, norms,
VSE, router, shared expert, selection bias) in `mp_rank_{TP:02d}_model_states.pt`; only the ZeRO
optimizer shards depend on the expert-parallel size. `pretrain.checkpoint.load` therefore resumes
a checkpoint at another EP size directly (weights and LR schedule restored, optimizer moments
restarted); this tool converts between the DeepSpeed layout and one plain, EP-independent state
dict of one tensor-parallel rank, with experts in global, expert-major order:

    python -m tools.convert_experts --checkpoint RUN_DIR[/checkpoints/step_00000100] --out model_tp00.pt [--mp-rank 0]

`load_full_state_dict(model, full)` loads such a state dict into a model built at any EP size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pretrain.checkpoint import torch_save_atomic
from pretrain.checkpoint_format import EXPERT_KEY, local_expert_state, read_meta, resolve_checkpoint
from pretrain.consolidate import describe_layout, rank_state
from tools.cli import ToolError, argument_parser, check_out_file, reports_errors, run


def expert_major_state(tag_dir: str | Path, mp_rank: int = 0) -> dict[str, torch.Tensor]:
    """One TP rank's full model state dict from a checkpoint tag (or run) directory, checked
    complete first; experts under their global ids in expert-major order, dtypes as saved."""
    tag_dir = resolve_checkpoint(tag_dir)
    layout = describe_layout(tag_dir, read_meta(tag_dir))
    if not layout["experts"]:
        raise ToolError(f"{tag_dir}: no expert files; this checkpoint has no MoE/UoE layers")
    if not 0 <= mp_rank < layout["tensor"]:
        raise ToolError(f"--mp-rank {mp_rank}: {tag_dir} was saved at tensor-parallel size {layout['tensor']}; "
                        f"give a rank from 0 to {layout['tensor'] - 1}")
    state = rank_state(tag_dir, mp_rank, layout)
    return dict(sorted(state.items(), key=lambda kv: _order(kv[0])))


def _order(key: str):
    m = EXPERT_KEY.match(key)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else (key, -1, "")


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load an EP-independent state dict into a model built at megatron-core's current EP size."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
    model.load_state_dict(local_expert_state(full, ep, rank), strict=True)


@reports_errors()
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", help="RUN_DIR (newest complete) or RUN_DIR/checkpoints/TAG")
    parser.add_argument("--out", help="output .pt file (one per TP rank)")
    parser.add_argument("--mp-rank", type=int, default=0, help="tensor-parallel rank to convert")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)  # CHECKPOINT OUT, as earlier versions took them
    args = parser.parse_intermixed_args(argv)  # CHECKPOINT --mp-rank 0 OUT, as earlier versions took them
    if args.paths:
        if len(args.paths) != 2 or args.checkpoint or args.out:
            parser.error("give --checkpoint CHECKPOINT --out FILE")
        args.checkpoint, args.out = args.paths
    if not (args.checkpoint and args.out):
        parser.error("the following arguments are required: --checkpoint, --out")
    out = Path(args.out)
    check_out_file(out, {"the checkpoint": args.checkpoint})
    if out.exists() and not args.overwrite:
        raise ToolError(f"--out {out} exists; choose a new file or pass --overwrite")
    state = expert_major_state(args.checkpoint, args.mp_rank)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_save_atomic(state, out)
    n = sum(1 for k in state if EXPERT_KEY.match(k))
    print(f"wrote {args.out}: {len(state)} tensors, {n} of them expert weights (global expert-major order)")
    return 0


if __name__ == "__main__":
    run(main)
