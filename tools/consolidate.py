"""Write a checkpoint of any layout (tensor / expert / data parallel, ZeRO 0-3) as one full fp32
state dict, keyed like the model at tensor- and expert-parallel size 1.

    python -m tools.consolidate --checkpoint RUN_DIR[/checkpoints/TAG] --out weights.pt

The file holds {"model": the model config, "state_dict": ..., "step": ..., "checkpoint": ...,
"tokenizer_sha256": the run's tokenizer, "start_with_bos": whether the run's samples began with BOS, "posttrain": {"chat": ..., "scores": ...}
after post-training (the chat and SGA score formats; a value head is left out)}:
`train.init_from=weights.pt` starts a run from it at any layout, and torch.load reads it without
this framework.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.checkpoint import torch_save_atomic
from pretrain.checkpoint_format import resolve_checkpoint
from pretrain.consolidate import load_model, run_config
from pretrain.data import starts_with_bos
from tools.cli import ToolError, argument_parser, check_out_file, reports_errors, run


@reports_errors()
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True, help="RUN_DIR (newest complete) or RUN_DIR/checkpoints/TAG")
    parser.add_argument("--out", required=True, help="output .pt file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    check_out_file(out, {"the checkpoint": resolve_checkpoint(args.checkpoint)})
    if out.exists() and not args.overwrite:
        raise ToolError(f"--out {out} exists; choose a new file or pass --overwrite")
    model, cfg, meta = load_model(args.checkpoint)
    state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    out.parent.mkdir(parents=True, exist_ok=True)
    run = run_config(resolve_checkpoint(args.checkpoint))
    # What post-training starting from the file begins its examples with (unknown without the run's config).
    starts = starts_with_bos(run, meta)
    carried = {"start_with_bos": starts} if starts is not None else {}
    posttrain = meta.get("posttrain", {})
    # The chat and score formats the model learned (SGA's conditioning text); not the value head
    if formats := {k: posttrain[k] for k in ("chat", "scores") if k in posttrain}:
        carried["posttrain"] = formats
    torch_save_atomic({"model": meta["model"], "state_dict": state, "step": meta.get("step"),
                       "checkpoint": meta["checkpoint"], "tokenizer_sha256": meta.get("tokenizer_sha256"),
                       **carried}, out)
    print(f"wrote {out}: {len(state)} tensors, {sum(v.numel() for v in state.values()):,} parameters, "
          f"step {meta.get('step')} of {meta['checkpoint']}")
    return 0


if __name__ == "__main__":
    run(main)
