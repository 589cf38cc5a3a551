"""The MoE/UoE dispatch and combine (models.moe.dispatch), forward + backward, against a reference in
this script that sums each token's expert rows with index_add (what the dispatch did before it
gathered), eagerly and under torch.compile, on whatever device is present.

    python -m bench.dispatch_speed [--tokens 8192 --hidden 512 --experts 8 --top-k 2 --repeats 9]

The experts are left out (each row scaled by 1.5), so the table times the dispatch alone: the sort,
the gathers, the weighted sum per token and their backward. On a GPU index_add adds rows
atomically; on a CPU it does not, so a CPU run says little about the GPU. The two variants take
turns, and each row gives the median and range of its repeats. Writes dispatch_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.provenance import provenance
from models.moe.dispatch import dispatch_combine, expert_counts


def index_add_reference(x, expert_ids, weights, experts, num_experts, group=None, run_local=None,
                        may_drop: bool = False):
    """The same dropless result by index_select gathers (backward: index_add) and an index_add sum."""
    T, K = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_tokens = order // K
    counts = expert_counts(flat_ids[order], num_experts)
    out = run_local(x.index_select(0, sorted_tokens), counts)
    out = out * weights.reshape(-1).index_select(0, order).to(out.dtype).unsqueeze(-1)
    return x.new_zeros(T, out.shape[-1]).index_add(0, sorted_tokens, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"],
                        default=["bfloat16", "float32"])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(args.tokens, args.experts, generator=gen).topk(args.top_k, dim=-1).indices.to(device)
    experts = [None] * args.experts  # run_local stands in for them

    def scaled(rows, counts):
        return rows * 1.5

    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
        w = torch.rand(args.tokens, args.top_k, generator=gen).to(device).requires_grad_()
        for mode in ("eager", "compiled"):
            variants = {"gathers": dispatch_combine, "index_add": index_add_reference}
            if mode == "compiled":
                variants = {name: torch.compile(fn) for name, fn in variants.items()}
            times = {name: [] for name in variants}
            for i in range(args.repeats + 2):  # two warm-up rounds (compilation)
                for name, fn in variants.items():
                    if device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    y = fn(x, ids, w, experts, args.experts, None, scaled, may_drop=False)
                    y.float().sum().backward()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if i >= 2:
                        times[name].append(1000 * (time.perf_counter() - start))
                    x.grad = w.grad = None
            for name, ms in times.items():
                rows.append({"dtype": dtype_name, "mode": mode, "variant": name, "median_ms": statistics.median(ms),
                             "min_ms": min(ms), "max_ms": max(ms)})
            gathers, reference = (statistics.median(times[n]) for n in ("gathers", "index_add"))
            rows[-2]["x_index_add"] = gathers / reference
            write(args, device, rows)  # after every pair: a run stopped from outside keeps them
    print(f"{'dtype':<10}{'mode':<10}{'variant':<11}{'median ms':>10}{'range':>18}{'x index_add':>13}")
    for r in rows:
        ratio = f"{r['x_index_add']:.2f}" if "x_index_add" in r else ""
        spread = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"
        print(f"{r['dtype']:<10}{r['mode']:<10}{r['variant']:<11}{r['median_ms']:>10.2f}{spread:>18}{ratio:>13}")


def write(args, device: str, rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    result = {"settings": vars(args), "device": machine, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "provenance": provenance("bench.dispatch_speed"), "rows": rows}
    (out / "dispatch_speed.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
