"""All-softmax vs all-ReLU vs hybrid attention: a short training comparison on the same shards and
tokens through the real trainer (dense MLP, configs/tiny_dense.yaml), over several seeds (train.seed:
the initial weights; the data order is the same for all). Every
sample begins with BOS (data.start_with_bos), so the attention-sink rate reads the weight on the
same token in every sample.

    python -m bench.attention_train [--steps 300 --seeds 0 1 2 --shards data/demo/shards]
    python -m bench.attention_train --set lisa     # LISA's head alignment: FFN vs linear (+ GQA)

Reports the final validation loss (mean ± sd and range over seeds), tokens/s, the attention-sink
rate Sink_1^0.3 (share of heads whose mean weight on the first token exceeds 0.3) and alpha_1 (that
mean weight, averaged over heads; ReLU heads have unnormalised weights, see models/sinks.py); writes
bench/results/attention_train.json and .png (loss curves with bands from the lowest to the highest
seed). `--set lisa` trains two softmax layers then two LISA layers (model.lisa.keep_full_layers=2)
with the FFN head alignment, with linear alignment only (the cheap one: on a GPU its scores are
feature products that flash kernels attend over), and linear alignment whose groups lie within
grouped-query K/V groups (one key per group: features one head wide), against all-softmax with and
without grouped-query attention: bench/results/attention_train_lisa.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.provenance import provenance
from bench.trainer_runs import (CURVE_LABEL, REPO, RunSettings, over_seeds, plot_bands, run_variant, separated,
                               welch_p)

VARIANT_SETS = {
    "kinds": {
        "softmax": ["model.attention=softmax"],
        "relu": ["model.attention=relu", "model.relu_attention.normalizer=content"],
        "hybrid srsl": ["model.attention=srsl", "model.relu_attention.normalizer=content"],
    },
    "lisa": {
        "softmax": ["model.attention=softmax"],
        "softmax gqa": ["model.attention=softmax", "model.num_kv_heads=2"],
        "lisa ffn": ["model.attention=ssll", "model.lisa.align_group=4", "model.lisa.align_hidden=16"],
        "lisa linear": ["model.attention=ssll", "model.lisa.align_group=4", "model.lisa.align_hidden=0"],
        "lisa linear gqa": ["model.attention=ssll", "model.num_kv_heads=2", "model.lisa.align_group=2",
                            "model.lisa.align_hidden=0"],
    },
}
REFERENCE = "softmax"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=sorted(VARIANT_SETS), default="kinds", help="which variants")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--shards", default="data/demo/shards")
    parser.add_argument("--tokenizer", default="data/demo/tokenizer")
    parser.add_argument("--runs", default=None, help="default runs/bench_attention_train[_SET]")
    parser.add_argument("--out", default=None, help="default bench/results/attention_train[_SET].json")
    args = parser.parse_args()
    variants = VARIANT_SETS[args.set]
    suffix = "" if args.set == "kinds" else f"_{args.set}"
    args.out = args.out or f"bench/results/attention_train{suffix}.json"
    args.runs = args.runs or f"runs/bench_attention_train{suffix}"
    settings = RunSettings(steps=args.steps, nproc=1, micro_batch=16, eval_batches=args.eval_batches,
                           shards=args.shards, tokenizer=args.tokenizer, device="cpu")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, overrides in variants.items():
            print(f"training {name} seed {seed} ...", flush=True)
            run = run_variant(name, "configs/tiny_dense.yaml", [*overrides, "data.start_with_bos=true"], settings,
                              seed, REPO / args.runs / f"{name.replace(' ', '_')}_seed{seed}")
            results.setdefault(name, []).append(run)
            summary = {}
            for variant, runs in results.items():
                summary[variant] = {"val_loss": over_seeds([r["val_loss"] for r in runs]),
                                    "sink_rate": over_seeds([r.get("sink_rate", float("nan")) for r in runs]),
                                    "alpha1_mean": over_seeds([r.get("alpha1_mean", float("nan")) for r in runs]),
                                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                                    "tokens": runs[0]["tokens"], "seeds": [r["seed"] for r in runs]}
            for variant, row in summary.items():
                if variant != REFERENCE and REFERENCE in summary:
                    row["minus_softmax"] = row["val_loss"]["mean"] - summary[REFERENCE]["val_loss"]["mean"]
                    row["separated_from_softmax"] = separated(row["val_loss"], summary[REFERENCE]["val_loss"])
                    row["welch_p_vs_softmax"] = welch_p(row["val_loss"], summary[REFERENCE]["val_loss"])
            meta = {"steps": args.steps, "seeds": args.seeds, "micro_batch": 16, "shards": args.shards,
                    "variants": variants, "data": "data.start_with_bos=true",
                    **provenance("bench.attention_train", shards=args.shards),
                    "note": "CPU, one process; 'apart' = the seed ranges of the final validation loss do not "
                            "overlap with softmax's; p (welch_p_vs_softmax) = Welch's t-test on those losses, "
                            "two-sided"}
            out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))
    print(f"{'attention':<16}{'val loss mean ± sd':>21}{'range':>17}{'vs softmax':>12}{'apart':>7}{'p':>6}"
          f"{'tok/s':>8}{'sink rate':>11}{'alpha_1':>9}")
    for name, r in summary.items():
        v, s = r["val_loss"], r["sink_rate"]
        diff = f"{r['minus_softmax']:+.4f}" if "minus_softmax" in r else "-"
        apart = ("yes" if r["separated_from_softmax"] else "no") if "separated_from_softmax" in r else "-"
        p = f"{r['welch_p_vs_softmax']:.2f}" if r.get("welch_p_vs_softmax") is not None else "-"
        print(f"{name:<16}{v['mean']:>12.4f} ± {v['sd']:.4f}{v['min']:>9.4f}-{v['max']:.4f}{diff:>12}"
              f"{apart:>7}{p:>6}{r['tokens_per_s']:>8.0f}{s['mean']:>8.2f}±{s['sd']:.2f}"
              f"{r['alpha1_mean']['mean']:>9.3f}")
    plot_bands({name: [r["loss_curve"] for r in runs] for name, runs in results.items()}, out.with_suffix(".png"),
               f"tiny dense models, samples begin with BOS, {args.steps} steps", CURVE_LABEL, window=3)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
