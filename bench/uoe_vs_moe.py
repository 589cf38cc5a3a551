"""Union-of-Experts against router MoE (with and without a shared expert) and a dense MLP at
matched active parameters, trained on the same shards and tokens through the real trainer, over
several seeds.

    python -m bench.uoe_vs_moe [--steps 400 --seeds 0 1 2 --only uoe moe]       # CPU, tiny models
    python -m bench.uoe_vs_moe --gpu [--device cpu --steps 2]                    # the 125m configs, one GPU

Variants, from one size's matched set (configs/{size}_{uoe,moe}.yaml and its dense twin;
N experts, top-k K, expert width D, shared width S, N_s = S / N):
* dense: a SwiGLU of width K*D + S;
* moe+shared: router MoE, experts of width D and a shared expert of width S;
* moe: router MoE without a shared expert, experts of width D + S/K (the same active width);
* uoe: UoE with the authors' carved sizing: experts of width D + N_s whose first N_s neurons route
  (the same total and active parameters as moe+shared, less its router), Switch aux loss 0.01;
* uoe-noaux: the same without any auxiliary loss (the authors report balance without one).
Every run uses train.seed = the seed (the initial weights; the data order, data.shuffle_seed, is
the same for every run, so seeds differ by initialisation only); a variant is "separated"
from uoe when the ranges of their final validation losses over the seeds do not overlap, and p is
Welch's t-test on those losses (two-sided; with three seeds only large gaps reach p < 0.05).

--gpu: the 125m configs at the demo vocabulary (42M active parameters) at sequence 2048 on one GPU
(EP=1, micro-batch 16, 300 steps = 9.8M tokens, about 2 minutes per model at 80k tokens/s), on shards of sequence 2048 built from the Python
standard library with the demo tokenizer data/demo/tokenizer (built first when missing:
data/gpu_uoe/shards, 3.5M tokens, so about 2.8 epochs; 2 validation batches = 32 of its 38
validation samples; carry both to a GPU machine to skip the build).
Writes bench/results/uoe_vs_moe[_gpu].json and .png (loss curves with bands from the lowest to the
highest seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.provenance import provenance
from bench.trainer_runs import (CURVE_LABEL, REPO, RunSettings, over_seeds, plot_bands, run_variant, separated,
                               welch_p)

SIZES = {"tiny": ("configs/tiny_uoe.yaml", "configs/tiny_moe.yaml", "configs/tiny_dense.yaml"),
         "125m": ("configs/125m_uoe.yaml", "configs/125m_moe.yaml", "configs/125m_moe_dense.yaml")}
REFERENCE = "uoe"


def variants(size: str) -> dict[str, tuple[str, list[str]]]:
    """{name: (config, overrides)} for one size's matched set."""
    from pretrain.config import load_config

    uoe_cfg, moe_cfg, dense_cfg = SIZES[size]
    moe = load_config(moe_cfg).model.moe
    d, s, n, k = moe.expert_hidden_size, moe.shared_hidden_size, moe.num_experts, moe.top_k
    if s % n or s % k:
        raise ValueError(f"{moe_cfg}: shared width {s} must divide by {n} experts and top-k {k}")
    carved = ["model.moe.sizing=carved", f"model.moe.expert_hidden_size={d + s // n}",
              f"model.moe.routing_neurons={s // n}", "model.moe.shared_hidden_size=0"]
    return {
        "dense": (dense_cfg, []),
        "moe+shared": (moe_cfg, []),
        "moe": (moe_cfg, ["model.moe.shared_hidden_size=0", f"model.moe.expert_hidden_size={d + s // k}"]),
        "uoe": (uoe_cfg, carved),
        "uoe-noaux": (uoe_cfg, [*carved, "model.moe.aux_loss_coef=0"]),
    }


def gpu_shards(path: Path, tokenizer: str) -> None:
    """Sequence-2048 shards from the standard library's .py files (the demo corpus), once."""
    if (path / "manifest.json").is_file():
        return
    print(f"building {path} (sequence 2048, Python standard library) ...", flush=True)
    subprocess.run([sys.executable, "-m", "data_prep.build_shards", "--tokenizer", tokenizer, "--out", str(path),
                    "--seq-len", "2048", "--val-fraction", "0.02", "--no-progress"], cwd=REPO, check=True)


def summarise(results: dict[str, list[dict]]) -> dict[str, dict]:
    table = {}
    for name, runs in results.items():
        row = {"val_loss": over_seeds([r["val_loss"] for r in runs]),
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
               "params_total": runs[0]["params_total"], "params_active": runs[0]["params_active"],
               "tokens": runs[0]["tokens"], "seeds": [r["seed"] for r in runs]}
        if "load_entropy" in runs[0]:
            row["load_entropy"] = over_seeds([r["load_entropy"] for r in runs])
            row["max_load"] = over_seeds([r["max_load"] for r in runs])
        table[name] = row
    if REFERENCE in table:
        ref = table[REFERENCE]["val_loss"]
        for name, row in table.items():
            if name != REFERENCE:
                row[f"minus_{REFERENCE}"] = row["val_loss"]["mean"] - ref["mean"]
                row[f"separated_from_{REFERENCE}"] = separated(row["val_loss"], ref)
                row[f"welch_p_vs_{REFERENCE}"] = welch_p(row["val_loss"], ref)
    return table


def print_table(table: dict[str, dict]) -> None:
    print(f"{'model':<12}{'total':>8}{'active':>8}{'val loss mean ± sd':>21}{'range':>17}{'vs uoe':>9}"
          f"{'apart':>7}{'p':>6}{'tok/s':>8}{'entropy':>9}{'max load':>9}")
    for name, r in table.items():
        v = r["val_loss"]
        diff = f"{r['minus_uoe']:+.4f}" if "minus_uoe" in r else "-"
        apart = ("yes" if r["separated_from_uoe"] else "no") if "separated_from_uoe" in r else "-"
        p = f"{r['welch_p_vs_uoe']:.2f}" if r.get("welch_p_vs_uoe") is not None else "-"
        ent = f"{r['load_entropy']['mean']:.3f}" if "load_entropy" in r else "-"
        mx = f"{r['max_load']['max']:.2f}" if "max_load" in r else "-"
        print(f"{name:<12}{r['params_total'] / 1e6:7.2f}M{r['params_active'] / 1e6:7.2f}M"
              f"{v['mean']:>12.4f} ± {v['sd']:.4f}{v['min']:>9.4f}-{v['max']:.4f}{diff:>9}{apart:>7}{p:>6}"
              f"{r['tokens_per_s']:>8.0f}{ent:>9}{mx:>9}")


def ran_on(device: str) -> str:
    """What --device ran on: the GPU's name, or the CPU (auto without a GPU)."""
    import torch

    return torch.cuda.get_device_name() if device == "auto" and torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the 125M preset at sequence 2048 on one GPU")
    parser.add_argument("--steps", type=int, help="default 400 (CPU) or 300 (--gpu)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nproc", type=int, default=1, help="processes; sparse models run at EP = nproc")
    parser.add_argument("--micro-batch", type=int, help="per process; default 16 / nproc (CPU), 16 (--gpu)")
    parser.add_argument("--eval-batches", type=int, help="default 16 (CPU) or 2 (--gpu)")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--shards", help="default data/demo/shards (CPU) or data/gpu_uoe/shards (--gpu)")
    parser.add_argument("--tokenizer", default="data/demo/tokenizer")
    parser.add_argument("--runs", default="runs/bench_uoe_vs_moe")
    parser.add_argument("--out", help="default bench/results/uoe_vs_moe[_gpu].json")
    parser.add_argument("--only", nargs="*", help="variants to run (default: all)")
    args = parser.parse_args()

    size = "125m" if args.gpu else "tiny"
    shards = args.shards or ("data/gpu_uoe/shards" if args.gpu else "data/demo/shards")
    if not (REPO / args.tokenizer / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer.json there (bash launch/demo.sh writes "
                         "data/demo/tokenizer; carry it to a GPU machine with the shards)")
    if args.gpu:
        gpu_shards(REPO / shards, args.tokenizer)
    settings = RunSettings(steps=args.steps or (300 if args.gpu else 400), nproc=args.nproc,
                           micro_batch=args.micro_batch or (16 if args.gpu else max(1, 16 // args.nproc)),
                           eval_batches=args.eval_batches or (2 if args.gpu else 16), shards=shards,
                           tokenizer=args.tokenizer,
                           device=args.device)
    # One ZeRO stage for every variant (the tiny configs differ), so tokens/s compares the layers alone.
    extra = ["parallel.zero_stage=1"]
    if args.gpu:  # one GPU: no expert parallelism; the data's vocabulary
        from pretrain.config import load_config

        vocab = json.loads((REPO / shards / "manifest.json").read_text())["vocab_size"]
        extra.append(f"model.vocab_size={vocab}")
        assert load_config(SIZES[size][0]).model.max_seq_len == 2048
    chosen = {k: v for k, v in variants(size).items() if not args.only or k in args.only}
    out = Path(args.out or f"bench/results/uoe_vs_moe{'_gpu' if args.gpu else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # seed-major: an interrupted bench still has every variant at the first seeds
        for name, (config, overrides) in chosen.items():
            print(f"training {name} seed {seed} ...", flush=True)
            run = run_variant(name, config, [*overrides, *extra], settings, seed,
                              REPO / args.runs / f"{name}_seed{seed}", expert_parallel=name != "dense")
            results.setdefault(name, []).append(run)
            print(f"  val loss {run['val_loss']:.4f}, {run['tokens_per_s']:.0f} tokens/s, {run['wall_s']:.0f} s",
                  flush=True)
            table = summarise(results)
            meta = {"size": size, "steps": settings.steps, "nproc": args.nproc, "micro_batch": settings.micro_batch,
                    "zero_stage": 1,
                    "shards": shards, "seeds": args.seeds, "device": ran_on(args.device), "variants": chosen,
                    **provenance("bench.uoe_vs_moe", shards=shards),
                    "note": "train.seed sets the initial weights (the data order is the same for all runs); "
                            "tokens/s is the median over log "
                            "intervals of all processes (noisy on a shared machine); 'apart' = the seed ranges "
                            "of the final validation loss do not overlap with uoe's; p (welch_p_vs_uoe) = "
                            "Welch's t-test on those losses, two-sided"}
            out.write_text(json.dumps({"meta": meta, "summary": table, "runs": results}, indent=1))
    print_table(summarise(results))
    plot_bands({name: [r["loss_curve"] for r in runs] for name, runs in results.items()}, out.with_suffix(".png"),
               f"{size} models, matched active parameters, {settings.steps} steps", CURVE_LABEL, window=3)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
