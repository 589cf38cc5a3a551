"""Dense vs MoE+shared expert vs Union-of-Experts (overlap and disjoint VSE) at matched active
parameters, trained on the same shards, tokens and seed through the real trainer.

    python -m bench.uoe_vs_moe [--steps 150 --nproc 2 --shards data/demo/shards]

The models are the `tiny` set of tools.matching (configs/tiny_{uoe,moe}.yaml and
configs/tiny_dense.yaml); sparse models run at expert-parallel size = nproc. Reports final
validation loss, training tokens/s, routing load entropy and max load as a table, writes
bench/results/uoe_vs_moe.json and bench/results/uoe_vs_moe.png (loss curves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "dense": ("configs/tiny_dense.yaml", []),
    "moe+shared": ("configs/tiny_moe.yaml", []),
    "uoe-overlap": ("configs/tiny_uoe.yaml", ["model.moe.vse_mode=overlap"]),
    "uoe-disjoint": ("configs/tiny_uoe.yaml", ["model.moe.vse_mode=disjoint"]),
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def run_variant(name: str, config: str, extra: list[str], args, run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    sparse = "dense" not in name
    overrides = [
        f"run.dir={run_dir}", f"run.name={name}", f"data.shards={args.shards}", f"data.tokenizer={args.tokenizer}",
        f"train.steps={args.steps}", f"train.warmup_steps={max(1, args.steps // 10)}", "train.log_interval=10",
        f"train.eval_interval={args.steps}", f"train.eval_batches={args.eval_batches}",
        f"train.save_interval={10 * args.steps}", "train.resume=none", f"train.seed={args.seed}",
        f"parallel.expert={args.nproc if sparse else 1}", *extra,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{29700 + hash(name) % 200}", "-m", "pretrain.train", "--config", config,
           *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in metrics if "train/loss" in m]
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    routing = [m for m in metrics if "routing/load_entropy" in m]
    throughput = [m["train/tokens_per_s"] for m in train[1:]] or [m["train/tokens_per_s"] for m in train]
    params = json.loads((run_dir / "checkpoints" / f"step_{args.steps:08d}" / "COMPLETE").read_text())["params"]
    out = {
        "config": config, "overrides": extra, "params_total": params["total"], "params_active": params["active"],
        "val_loss": val[-1] if val else None, "final_train_loss": train[-1]["train/loss"],
        "tokens_per_s": statistics.median(throughput), "tokens_per_s_best": max(throughput),
        "wall_s": time.time() - start,
        "loss_curve": [[r["step"], r["loss"]] for r in read_jsonl(run_dir / "losses.jsonl")],
    }
    if routing:
        last = routing[-3:]
        out["load_entropy"] = statistics.mean(m["routing/load_entropy"] for m in last)
        out["max_load"] = max(m["routing/max_load"] for m in last)
        ratios = [v for m in last for k, v in m.items() if k.endswith("vse_over_routed")]
        if ratios:
            out["vse_over_routed"] = statistics.mean(ratios)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        steps, losses = zip(*r["loss_curve"])
        window = 10
        smooth = [statistics.mean(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, label=f"{name} (val {r['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss ({window}-step mean)")
    ax.set_title("matched active parameters, same tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--shards", default="data/demo/shards")
    parser.add_argument("--tokenizer", default="data/demo/tokenizer")
    parser.add_argument("--runs", default="runs/bench_uoe_vs_moe")
    parser.add_argument("--out", default="bench/results/uoe_vs_moe.json")
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS))
    args = parser.parse_args()

    results = {}
    for name, (config, extra) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        print(f"training {name} ...", flush=True)
        results[name] = run_variant(name, config, extra, args, REPO / args.runs / name)

    header = (f"{'model':<14}{'total':>9}{'active':>9}{'val loss':>10}{'tok/s':>9}{'best':>9}{'entropy':>9}"
              f"{'max load':>9}")
    print(header)
    for name, r in results.items():
        ent = f"{r['load_entropy']:.3f}" if "load_entropy" in r else "-"
        mx = f"{r['max_load']:.2f}" if "max_load" in r else "-"
        print(f"{name:<14}{r['params_total'] / 1e6:8.2f}M{r['params_active'] / 1e6:8.2f}M{r['val_loss']:>10.4f}"
              f"{r['tokens_per_s']:>9.0f}{r['tokens_per_s_best']:>9.0f}{ent:>9}{mx:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"steps": args.steps, "nproc": args.nproc, "shards": args.shards, "seed": args.seed,
            "note": "CPU gloo run; tokens/s counts all processes; median and best over log intervals "
                    "(a shared machine makes the median noisy)"}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
