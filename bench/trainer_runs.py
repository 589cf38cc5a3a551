"""Runs of the real trainer for the benches that compare models (bench.uoe_vs_moe,
bench.attention_train): one run per (variant, seed) through torchrun and pretrain.train, read back
from its metrics, summarised over seeds (mean, sample standard deviation, range) and drawn as loss
curves with a band from the lowest to the highest seed."""

from __future__ import annotations

import json
import os
import shutil
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunSettings:
    steps: int
    nproc: int
    micro_batch: int  # per process
    eval_batches: int
    shards: str
    tokenizer: str
    device: str = "auto"  # auto: the trainer's choice (CUDA when there is one) | cpu
    evals: int = 4  # validation points over the run (the last at train.steps)
    log_interval: int = 10


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def run_variant(name: str, config: str, extra: list[str], settings: RunSettings, seed: int, run_dir: Path,
                expert_parallel: bool = False) -> dict:
    """Train `config` + `extra` overrides from scratch with train.seed = `seed`; return its numbers."""
    shutil.rmtree(run_dir, ignore_errors=True)
    s = settings
    eval_interval = max(1, s.steps // s.evals)
    overrides = [
        f"run.dir={run_dir}", f"run.name={name}", f"data.shards={s.shards}", f"data.tokenizer={s.tokenizer}",
        f"train.steps={s.steps}", f"train.warmup_steps={min(max(1, s.steps // 10), s.steps - 1)}",
        f"train.log_interval={s.log_interval}", f"train.eval_interval={eval_interval}",
        f"train.eval_batches={s.eval_batches}", f"train.save_interval={10 * s.steps}", "train.resume=none",
        f"train.seed={seed}", f"train.micro_batch={s.micro_batch}",
        f"parallel.expert={s.nproc if expert_parallel else 1}", *extra,
    ]
    port = 29700 + sum(map(ord, f"{name}{seed}")) % 250
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={s.nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "pretrain.train", "--config", config, *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if s.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in metrics if "train/loss" in m]
    vals = [(m["step"], m["val/loss"]) for m in metrics if "val/loss" in m]
    routing = [m for m in metrics if "routing/load_entropy" in m]
    sinks = [m for m in metrics if "sinks/sink_rate" in m]
    throughput = [m["train/tokens_per_s"] for m in train[1:]] or [m["train/tokens_per_s"] for m in train]
    complete = json.loads((run_dir / "checkpoints" / f"step_{s.steps:08d}" / "COMPLETE").read_text())
    out = {
        "seed": seed, "params_total": complete["params"]["total"], "params_active": complete["params"]["active"],
        "tokens": s.steps * complete["global_batch"] * complete["model"]["max_seq_len"],
        # The cross-entropy: the loss trained on adds the routers' aux loss (coef per routed layer when
        # balanced) to some variants and not to others.
        "val_loss": vals[-1][1] if vals else None, "val_curve": vals, "final_train_loss": cross_entropy(train[-1]),
        "tokens_per_s": statistics.median(throughput), "wall_s": time.time() - start,
        "loss_curve": [[m["step"], cross_entropy(m)] for m in train],  # every log step's
    }
    if routing:
        last = routing[-3:]
        out["load_entropy"] = statistics.mean(m["routing/load_entropy"] for m in last)
        out["max_load"] = max(m["routing/max_load"] for m in last)
    if sinks:  # the last evaluation's: share of heads past eps, and the mean weight on the first token
        out["sink_rate"], out["alpha1_mean"] = sinks[-1]["sinks/sink_rate"], sinks[-1]["sinks/alpha1_mean"]
    return out


CURVE_LABEL = "train cross-entropy (logged steps, 3-point mean)"


def cross_entropy(record: dict) -> float:
    """A logged training step's cross-entropy (train/ce_loss where the loss has more parts)."""
    return record.get("train/ce_loss", record["train/loss"])


def over_seeds(values: list[float]) -> dict:
    """mean, sample standard deviation (0 for one value), min, max, n and the values."""
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values), "values": list(values)}


def welch_p(a: dict, b: dict) -> float | None:
    """Two-sided p-value of Welch's t-test between two over_seeds summaries: how often seeds this far
    apart would come from variants that do not differ. None below two seeds each or without spread."""
    if min(a["n"], b["n"]) < 2 or "values" not in a or "values" not in b:
        return None
    from scipy.stats import ttest_ind

    p = float(ttest_ind(a["values"], b["values"], equal_var=False).pvalue)
    return None if math.isnan(p) else p


def separated(a: dict, b: dict) -> bool:
    """Whether two over_seeds summaries' ranges do not overlap (every seed of one is better); never
    from a single seed, which has no range."""
    return min(a["n"], b["n"]) > 1 and (a["max"] < b["min"] or b["max"] < a["min"])


def plot_bands(curves: dict[str, list[list[list[float]]]], path: Path, title: str, ylabel: str,
               window: int = 10) -> None:
    """curves: {variant: one [[step, value], ...] per seed}. Draws the mean over seeds of a
    `window`-point running mean, with a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, runs in curves.items():
        length = min(len(r) for r in runs)
        steps = [p[0] for p in runs[0][:length]]
        smooth = []
        for r in runs:
            values = [p[1] for p in r[:length]]
            smooth.append([statistics.mean(values[max(0, i - window + 1): i + 1]) for i in range(length)])
        mean = [statistics.mean(col) for col in zip(*smooth)]
        line, = ax.plot(steps, mean, label=f"{name} ({len(runs)} seeds)")
        ax.fill_between(steps, [min(c) for c in zip(*smooth)], [max(c) for c in zip(*smooth)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
