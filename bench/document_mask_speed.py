"""Attention within documents against plain causal attention: forward + backward time per kind.

    python -m bench.document_mask_speed [--seqs 256,1024] [--docs 4] [--repeats 5] [--out bench/results]

The same modules and timing as bench.attention_speed (one attention module, TP = 1, whatever
device is present), each run without and with ``document_ids`` for packed samples of ``--docs``
documents of random lengths (seeded). Masked softmax leaves SDPA's is_causal path for a boolean
block-causal mask; ReLU and LISA apply the mask in their own kernels. Ratios > 1 are the cost of
document masking; medians of ``--repeats`` runs, with min and max over 3 trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.attention_speed import time_kind
from bench.provenance import provenance
from models.attention.masks import document_ids

KINDS = ["softmax", "softmax_sink", "relu", "lisa"]


def packed_documents(batch: int, seq: int, docs: int, seed: int) -> torch.Tensor:
    """document_ids of samples holding ``docs`` documents with random boundaries."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.full((batch, seq), 5)
    for b in range(batch):
        ends = torch.randperm(seq - 1, generator=gen)[: docs - 1]
        tokens[b, ends] = 2
    return document_ids(tokens, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="256,1024")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    from pretrain.distributed import destroy_distributed, device, init_single_process

    init_single_process()
    dev = device()
    rows = []
    print(f"attention forward+backward with and without document masking ({args.docs} documents per sample), "
          f"batch {args.batch}, hidden {args.hidden}, heads {args.heads}, device {dev.type}")
    print(f"{'kind':<14}{'seq':>6}{'plain ms':>10}{'masked ms':>11}{'masked/plain':>14}{'min':>7}{'max':>7}")
    for seq in map(int, args.seqs.split(",")):
        documents = packed_documents(args.batch, seq, args.docs, seed=seq).to(dev)
        for kind in args.kinds.split(","):
            ratios, plain, masked = [], [], []
            for _ in range(3):
                plain.append(time_kind(kind, args.hidden, args.heads, seq, args.batch, args.repeats, dev))
                masked.append(time_kind(kind, args.hidden, args.heads, seq, args.batch, args.repeats, dev, documents))
                ratios.append(masked[-1] / plain[-1])
            row = {"kind": kind, "seq": seq, "plain_ms": 1000 * statistics.median(plain),
                   "masked_ms": 1000 * statistics.median(masked), "ratio": statistics.median(ratios),
                   "ratio_min": min(ratios), "ratio_max": max(ratios)}
            rows.append(row)
            print(f"{kind:<14}{seq:>6}{row['plain_ms']:>10.1f}{row['masked_ms']:>11.1f}{row['ratio']:>14.2f}"
                  f"{row['ratio_min']:>7.2f}{row['ratio_max']:>7.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev.type, "threads": torch.get_num_threads(), **provenance("bench.document_mask_speed", argv),
            "batch": args.batch, "hidden": args.hidden, "heads": args.heads, "docs": args.docs,
            "repeats": args.repeats, "trials": 3}
    (out / "document_mask_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'document_mask_speed.json'}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
