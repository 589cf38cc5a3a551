"""All-softmax vs all-ReLU vs hybrid attention: a short training comparison on the same shards,
tokens and seed through the real trainer (dense MLP, configs/tiny_dense.yaml).

    python -m bench.attention_train [--steps 150 --shards data/demo/shards]

Reports final validation loss, tokens/s and the attention-sink rate Sink_1^0.3 (share of heads
whose mean weight on the first token exceeds 0.3) as a table; writes bench/results/attention_train.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.uoe_vs_moe import read_jsonl, run_variant

VARIANTS = {
    "softmax": ["model.attention=softmax"],
    "relu": ["model.attention=relu"],
    "hybrid srsl": ["model.attention=srsl"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--shards", default="data/demo/shards")
    parser.add_argument("--tokenizer", default="data/demo/tokenizer")
    parser.add_argument("--runs", default="runs/bench_attention_train")
    parser.add_argument("--out", default="bench/results/attention_train.json")
    args = parser.parse_args()
    args.nproc = 1
    results = {}
    for name, overrides in VARIANTS.items():
        run_dir = Path(args.runs) / name.replace(" ", "_")
        results[name] = run_variant(name, "configs/tiny_dense.yaml", overrides, args, run_dir)
        sinks = [m["sinks/sink_rate"] for m in read_jsonl(run_dir / "metrics.jsonl") if "sinks/sink_rate" in m]
        results[name]["sink_rate"] = sinks[-1] if sinks else None
        del results[name]["loss_curve"]
    print(f"{'attention':<14}{'val loss':>10}{'tokens/s':>10}{'sink rate':>11}")
    for name, r in results.items():
        print(f"{name:<14}{r['val_loss']:>10.4f}{r['tokens_per_s']:>10.0f}{r['sink_rate']:>11.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
