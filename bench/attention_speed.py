"""Attention forward + backward time per kind, relative to softmax in the same run.

    python -m bench.attention_speed [--seqs 256,1024,2048] [--hidden 256] [--heads 4] [--out bench/results]

Times one attention module (projections + core + output projection) in one process (TP = 1) on
whatever device is present. Kinds: softmax (SDPA), softmax_sink (SDPA with a sink column), relu
(blocked ReLU attention), lisa (shared scores given, align FFN + low-rank Q/K), lisa_linear
(the same with model.lisa.align_hidden = 0: linear head mixing only), and
softmax+publish (a softmax layer that materialises its scores for a following LISA layer: the
extra cost a LISA layer puts on its predecessor).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

KINDS = ["softmax", "softmax_sink", "relu", "lisa", "lisa_linear", "softmax+publish"]


def build(kind: str, hidden: int, heads: int, seq: int):
    from models.config import ModelConfig
    from models.registry import build_attention

    cfg = ModelConfig(hidden_size=hidden, num_heads=heads, num_layers=2, max_seq_len=seq, attention="softmax")
    cfg.relu_attention.block_size = 256
    cfg.lisa.keep_full_layers = 1
    if kind in ("lisa", "lisa_linear"):
        cfg.attention = "softmax,lisa"
        cfg.lisa.align_hidden = 0 if kind == "lisa_linear" else cfg.lisa.align_hidden
        return build_attention(cfg, 1), cfg
    cfg.attention = "softmax" if kind == "softmax+publish" else kind
    module = build_attention(cfg, 0)
    module.publish_scores = kind == "softmax+publish"
    return module, cfg


def time_kind(kind: str, hidden: int, heads: int, seq: int, batch: int, repeats: int, device,
              documents: torch.Tensor | None = None) -> float:
    """Median seconds of one forward + backward (``documents``: attend within them, [batch, seq])."""
    from models.layers import Rotary

    module, cfg = build(kind, hidden, heads, seq)
    module = module.to(device)
    rotary = Rotary(cfg.head_dim, seq, cfg.rope_base).to(device)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    scores = torch.randn(batch, heads, seq, seq, device=device, requires_grad=True)
    times = []
    for i in range(repeats + 1):
        ctx = {"rotary": rotary, "attention_scores": {0: scores}, "document_ids": documents}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        module(x, ctx).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call is warm-up
            times.append(time.perf_counter() - t0)
        x.grad = scores.grad = None
        module.zero_grad(set_to_none=True)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="256,1024,2048")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    from pretrain.distributed import destroy_distributed, device, init_single_process

    init_single_process()
    dev = device()
    seqs = [int(s) for s in args.seqs.split(",")]
    kinds = args.kinds.split(",")
    rows = []
    print(f"attention forward+backward, batch {args.batch}, hidden {args.hidden}, heads {args.heads}, "
          f"device {dev.type} ({torch.get_num_threads()} threads), median of {args.repeats}")
    print(f"{'kind':<16}" + "".join(f"{f'seq {s} ms':>14}{'x softmax':>10}" for s in seqs))
    results = {k: {} for k in kinds}
    for s in seqs:
        for k in kinds:
            results[k][s] = time_kind(k, args.hidden, args.heads, s, args.batch, args.repeats, dev)
    for k in kinds:
        line = f"{k:<16}"
        for s in seqs:
            ms, rel = 1000 * results[k][s], results[k][s] / results["softmax"][s] if "softmax" in results else float("nan")
            line += f"{ms:>14.1f}{rel:>10.2f}"
            rows.append({"kind": k, "seq": s, "ms": ms, "relative_to_softmax": rel})
        print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev.type, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "batch": args.batch, "hidden": args.hidden, "heads": args.heads, "repeats": args.repeats}
    (out / "attention_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'attention_speed.json'}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
