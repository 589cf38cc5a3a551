"""Validation loss and perplexity of a checkpoint on any shard set, in one process.

    python -m pretrain.evaluate --checkpoint RUN_DIR[/checkpoints/TAG] --shards DIR \\
        [--split val] [--batches 8] [--batch-size 4]

--shards is a shard directory holding the split (DIR/val/index.json) or a split directory itself
(DIR/index.json). Samples are read in order, batch b holding samples [b*B, (b+1)*B) (wrapping
around a small split), so `--batches N --batch-size B` covers the same N*B samples the trainer's
validation covers with train.eval_batches * data-parallel size = N and micro_batch = B; the loss is
the trainer's (mean next-token cross-entropy over the padded vocabulary, no auxiliary losses).
Prints `loss L | perplexity P | tokens T`; --json prints a JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def split_dir(shards: str | Path, split: str) -> Path:
    shards = Path(shards)
    if (shards / "index.json").is_file():
        return shards
    if (shards / split / "index.json").is_file():
        return shards / split
    raise FileNotFoundError(f"--shards {shards}: neither {shards / split / 'index.json'} nor {shards / 'index.json'} "
                            "exists; point at a directory written by data_prep.build_shards (or its split)")


def read_rows(location: Path, count: int) -> torch.Tensor:
    """The first `count` samples [count, seq + 1] in order, wrapping around."""
    from streaming import StreamingDataset

    from pretrain.data import clean_shared_memory_once

    clean_shared_memory_once()
    dataset = StreamingDataset(local=str(location), shuffle=False, batch_size=1)
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{location} holds no samples")
    return torch.stack([torch.from_numpy(dataset[i % n]["tokens"].astype("int64")) for i in range(count)])


@torch.no_grad()
def evaluate_rows(model, rows: torch.Tensor, batch_size: int) -> dict:
    from megatron.core import tensor_parallel

    seq = rows.shape[1] - 1
    if seq > model.cfg.max_seq_len:
        raise ValueError(f"samples hold {seq} tokens but model.max_seq_len={model.cfg.max_seq_len}")
    if int(rows.max()) >= model.cfg.vocab_size:
        raise ValueError(f"the shards hold token id {int(rows.max())} >= model.vocab_size={model.cfg.vocab_size}: "
                         "they were built with another tokenizer")
    losses = []
    for batch in rows.split(batch_size):
        logits = model.logits(batch[:, :-1])
        losses.append(tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch[:, 1:]).mean().item())
    loss = sum(losses) / len(losses)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "batches": len(losses),
            "tokens": int(rows[:, 1:].numel()), "batch_losses": losses}


def main(argv: list[str] | None = None) -> int:
    from pretrain.consolidate import ConsolidateError, load_model

    parser = argparse.ArgumentParser(prog="python -m pretrain.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--shards", required=True, help="shard directory (with SPLIT/) or a split directory")
    parser.add_argument("--split", default="val")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1:
        print("error: --batches and --batch-size must be >= 1", file=sys.stderr)
        return 2
    try:
        location = split_dir(args.shards, args.split)
        model, cfg, meta = load_model(args.checkpoint)
        rows = read_rows(location, args.batches * args.batch_size)
        result = evaluate_rows(model, rows, args.batch_size)
    except (ConsolidateError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    result.update(checkpoint=meta["checkpoint"], step=meta.get("step"), shards=str(location))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | tokens {result['tokens']} "
              f"| step {result['step']} | {location}")
    return 0


if __name__ == "__main__":
    from pretrain.distributed import run_cli

    run_cli(main)
