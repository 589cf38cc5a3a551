"""The trigger-conditional task of "Attention Sinks Are Provably Necessary in Softmax Transformers"
in the paper's own setting: its data, its attention-only models and its training, with seeds, and
only converged runs read as evidence.

    python -m bench.sink_paper [--seeds 0 1 2] [--models 1x1 2x2 4x4] [--max-steps 50000] [--workers 2]
    python -m bench.sink_paper --kinds ours-softmax ours-softmax_sink ours-relu-prefix ... --name sink_paper_ours

Data (d = 16, L = 16): position 0 is BOS = e_0; every other token has coordinates 2..d-2 i.i.d.
U(-1, 1) and its last coordinate 1, except the trigger, at a position uniform in 3..L (1-indexed),
whose coordinate 1 is 1 and last coordinate 0 (it keeps its noise). Target: zero everywhere but at
the trigger j, where it is the mean of tokens 1..j (BOS excluded, trigger included); the multi-layer
(residual) task targets x everywhere plus that mean at the trigger.
Models: attention-only, no bias, no positional encoding, scores q.k without 1/sqrt(d), causal.
Heads are full width (d each), concatenated and projected back to d. softmax: masked softmax;
relu: ReLU(q.k) with row i (0-indexed) divided by max(i, 1), its number of non-BOS keys. One layer
without residual (1x1); L layers x H heads with residuals (2x2, 4x4). Weights N(0, 0.02).
Training: Adam betas (0.9, 0.95), lr 1e-3 (one layer) / 1e-4 (multi-layer), batch 128, MSE over
every position and coordinate, until the batch's L-infinity error is below 5e-3 or --max-steps.

Reported per model, kind and seed: converged or not, steps, test MSE and L-infinity error on 1,000
fresh inputs with the trigger at position 8 (1-indexed), and the attention on BOS of the queries
that are not the trigger (per layer and head, mean over the test inputs), the paper's sink; also
this project's Sink_1^0.3 (models.sinks). Heatmaps as the paper draws them: the attention of the
single layer averaged over the 1,000 test inputs, and one test input per head for multi-layer
models (Blues, 0..1). Writes bench/results/sink_paper.json and bench/results/sink_paper/*.png.

The "ours-*" kinds put this project's attention weight functions (models.attention: causal softmax,
softmax with a learned sink logit, ReLU with each normaliser: prefix = i + 1 keys, content =
max(i, 1) keys as the paper's ReLU, none, seqlen)
with their own 1/sqrt(d) scores into the same layers. For softmax_sink the attention on BOS is
that on the real first key; the sink logit's share is not a key.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import torch
from torch import nn

from bench.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
STOP = 5e-3
TEST_TRIGGER = 8  # 1-indexed, as the paper's figures


def trigger_batch(batch: int, seq: int = 16, dim: int = 16, generator: torch.Generator | None = None,
                  trigger: int | None = None, residual: bool = False):
    """(x [B, L, d], y [B, L, d], trigger positions [B], 0-indexed). `trigger`: a fixed 1-indexed position."""
    x = torch.zeros(batch, seq, dim)
    x[:, 0, 0] = 1.0  # BOS
    x[:, 1:, 2:dim - 1] = torch.rand(batch, seq - 1, dim - 3, generator=generator) * 2 - 1
    x[:, 1:, dim - 1] = 1.0
    if trigger is None:
        j = torch.randint(2, seq, (batch,), generator=generator)  # 0-indexed 2..L-1 = 1-indexed 3..L
    else:
        j = torch.full((batch,), trigger - 1)
    rows = torch.arange(batch)
    x[rows, j, 1] = 1.0
    x[rows, j, dim - 1] = 0.0
    y = x.clone() if residual else torch.zeros_like(x)
    positions = torch.arange(seq)
    upto = ((positions[None, :] >= 1) & (positions[None, :] <= j[:, None])).float()  # tokens 1..j
    mean = (upto[:, :, None] * x).sum(1) / j[:, None].float()
    y[rows, j] += mean
    return x, y, j


# This project's attention weight functions, each with its own scores (q.k / sqrt(d)), in the
# paper's layers: "ours-<kind>[-<relu normaliser>]".
PROJECT_KINDS = ("ours-softmax", "ours-softmax_sink", "ours-relu-prefix", "ours-relu-content", "ours-relu-none",
                 "ours-relu-seqlen")


class PaperAttention(nn.Module):
    """One attention-only layer: H full-width heads, concatenated, projected; no bias, no scaling
    (the paper's kinds softmax / relu), or one of PROJECT_KINDS."""

    def __init__(self, dim: int, heads: int, kind: str):
        super().__init__()
        self.heads, self.kind = heads, kind
        self.q, self.k, self.v = (nn.Linear(dim, heads * dim, bias=False) for _ in range(3))
        self.o = nn.Linear(heads * dim, dim, bias=False)
        for linear in (self.q, self.k, self.v, self.o):
            nn.init.normal_(linear.weight, std=0.02)
        if kind == "ours-softmax_sink":
            # neutral at the start (models.attention.sink draws N(0, 0.02))
            self.sink = nn.Parameter(torch.zeros(heads))

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, L] attention weights."""
        b, seq, dim = x.shape
        q = self.q(x).view(b, seq, self.heads, dim).transpose(1, 2)
        k = self.k(x).view(b, seq, self.heads, dim).transpose(1, 2)
        if self.kind.startswith("ours-"):
            return self.project_weights(q, k)
        scores = q @ k.transpose(-1, -2)
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        if self.kind == "softmax":
            return scores.masked_fill(future, torch.finfo(scores.dtype).min).softmax(-1)
        keys = torch.arange(seq).clamp(min=1).to(scores.dtype)  # row i: its i non-BOS keys
        return torch.relu(scores.masked_fill(future, 0.0)) / keys[:, None]

    def project_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        from models.attention.base import scaled_scores
        from models.attention.relu import relu_weights
        from models.attention.sink import sink_softmax_weights
        from models.attention.softmax import causal_softmax

        scores = scaled_scores(q, k)
        if self.kind == "ours-softmax":
            return causal_softmax(scores)
        if self.kind == "ours-softmax_sink":
            return sink_softmax_weights(scores, self.sink)
        return relu_weights(scores, self.kind.removeprefix("ours-relu-"))

    def forward(self, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        b, seq, dim = x.shape
        attn = self.weights(x)
        if keep is not None:
            keep.append(attn.detach())
        v = self.v(x).view(b, seq, self.heads, dim).transpose(1, 2)
        return self.o((attn @ v).transpose(1, 2).reshape(b, seq, self.heads * dim))


class PaperModel(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, kind: str):
        super().__init__()
        self.residual = layers > 1
        self.layers = nn.ModuleList(PaperAttention(dim, heads, kind) for _ in range(layers))

    def forward(self, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, keep) + x if self.residual else layer(x, keep)
        return x


def train_one(spec: tuple[str, int, int, int, int]) -> dict:
    kind, layers, heads, seed, max_steps = spec
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(10_000 + seed)
    model = PaperModel(16, layers, heads, kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 if layers == 1 else 1e-4, betas=(0.9, 0.95))
    started, step, linf = time.perf_counter(), 0, math.inf
    residual = layers > 1
    while step < max_steps:
        x, y, _ = trigger_batch(128, generator=data, residual=residual)
        pred = model(x)
        linf = float((pred - y).detach().abs().max())
        if linf < STOP:
            break
        loss = nn.functional.mse_loss(pred, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
    test = torch.Generator().manual_seed(20_000 + seed)
    x, y, j = trigger_batch(1000, generator=test, trigger=TEST_TRIGGER, residual=residual)
    keep: list = []
    with torch.no_grad():
        pred = model(x, keep)
    maps = torch.stack(keep, 1)  # [B, layers, H, L, L]
    queries = [q for q in range(1, 16) if q != TEST_TRIGGER - 1]
    bos = maps[:, :, :, queries, 0].mean((0, 3))  # [layers, H]: BOS attention of non-trigger queries
    from models.sinks import DEFAULT_EPS, sink_stats

    sinks = sink_stats({layer: maps[:, layer] for layer in range(layers)})  # all queries
    alpha1 = sinks.alpha1  # [layers, H]
    return {"kind": kind, "layers": layers, "heads": heads, "seed": seed, "converged": linf < STOP, "steps": step,
            "train_linf": linf, "test_mse": float(nn.functional.mse_loss(pred, y)),
            "test_linf": float((pred - y).abs().max()), "bos_attention": bos.tolist(), "alpha1": alpha1.tolist(),
            "sink_rate": sinks.sink_rate(DEFAULT_EPS),
            "seconds": time.perf_counter() - started,
            "mean_map": maps.mean(0).tolist() if layers == 1 else None, "example_map": maps[0].tolist()}


def draw(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = torch.tensor(result["mean_map"] if result["layers"] == 1 else result["example_map"])  # [layers?, H, L, L]
    if result["layers"] == 1:
        maps = maps[0] if maps.dim() == 4 else maps
        panels = [("mean over 1,000 test inputs", maps[0])]
    else:
        panels = [(f"layer {li + 1}, head {h + 1}", maps[li, h]) for li in range(maps.shape[0]) for h in range(maps.shape[1])]
    cols = min(len(panels), 4) if result["layers"] == 1 or len(panels) <= 4 else result["heads"]
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax, (title, m) in zip(axes.flat, panels):
        ax.imshow(m.numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_title(title, fontsize=8)
        ax.set_xticks(range(1, 16, 2), [str(t) for t in range(2, 17, 2)], fontsize=6)
        ax.set_yticks(range(1, 16, 2), [str(t) for t in range(2, 17, 2)], fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    state = "converged" if result["converged"] else "NOT converged"
    fig.suptitle(f"{result['kind']} {result['layers']}L{result['heads']}H seed {result['seed']} ({state}, "
                 f"{result['steps']} steps)", fontsize=9)
    fig.tight_layout()
    path = out / f"{result['kind']}_{result['layers']}L{result['heads']}H_seed{result['seed']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--models", nargs="+", default=["1x1", "2x2", "4x4"], help="LAYERSxHEADS")
    parser.add_argument("--kinds", nargs="+", default=["softmax", "relu"], choices=["softmax", "relu", *PROJECT_KINDS],
                        help=f"softmax, relu (the paper's) or this project's: {', '.join(PROJECT_KINDS)}")
    parser.add_argument("--max-steps", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="sink_paper", help="results: OUT/NAME.json and OUT/NAME/*.png")
    args = parser.parse_args(argv)
    sizes = [re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", m) for m in args.models]
    if not all(sizes):
        parser.error(f"--models {' '.join(args.models)}: give LAYERSxHEADS such as 2x2")
    specs = [(kind, int(size[1]), int(size[2]), seed, args.max_steps)
             for size in sizes for kind in args.kinds for seed in args.seeds]
    out = REPO / args.out
    pictures = out / args.name
    pictures.mkdir(parents=True, exist_ok=True)
    print(f"{'model':<8}{'kind':<9}{'seed':>5}{'converged':>11}{'steps':>8}{'test MSE':>11}{'test Linf':>10}"
          f"{'Sink_1^0.3':>11}  BOS attention of non-trigger queries (layer: heads)", flush=True)
    results: list[dict] = []
    import multiprocessing as mp

    # Finished runs are written as they come, so a stopped bench keeps what it measured.
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for r in pool.imap_unordered(train_one, specs):
            r["heatmap"] = str(draw(r, pictures).relative_to(out))
            r.pop("mean_map")
            r.pop("example_map")
            results.append(r)
            bos = "; ".join(f"L{i + 1}: " + " ".join(f"{v:.2f}" for v in heads)
                            for i, heads in enumerate(r["bos_attention"]))
            print(f"{r['layers']}L{r['heads']}H{'':<4}{r['kind']:<9}{r['seed']:>5}"
                  f"{'yes' if r['converged'] else 'NO':>11}{r['steps']:>8}{r['test_mse']:>11.2e}"
                  f"{r['test_linf']:>10.4f}{r['sink_rate']:>11.2f}  {bos}", flush=True)
            write_results(out, args, specs, results)
    summary = write_results(out, args, specs, results)
    print("converged runs only are evidence; " + ", ".join(f"{k}: {v['converged']}/{v['runs']} converged"
                                                          for k, v in summary.items()))
    print(f"wrote {out / (args.name + '.json')} and {len(results)} heatmaps in {pictures}")
    return 0


def write_results(out: Path, args, specs: list, results: list[dict]) -> dict:
    summary = {}
    for r in sorted(results, key=lambda r: (r["layers"], r["kind"], r["seed"])):
        key = f"{r['kind']} {r['layers']}L{r['heads']}H"
        entry = summary.setdefault(key, {"runs": 0, "converged": 0, "bos_attention_converged": []})
        entry["runs"] += 1
        if r["converged"]:
            entry["converged"] += 1
            entry["bos_attention_converged"].append(r["bos_attention"])
    done = {(r["kind"], r["layers"], r["heads"], r["seed"]) for r in results}
    missing = [list(s[:4]) for s in specs if tuple(s[:4]) not in done]
    result = {"settings": vars(args), "provenance": provenance("bench.sink_paper"), "runs": results,
              "summary": summary, "not_run": missing}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
