"""The GPU check's report: markdown of its JSON, and the before -> now table against an earlier run
(--baseline)."""

from __future__ import annotations

import json
from pathlib import Path

CHECK = "check:"  # the part name of a check (bench.gpu_check.run_isolated)


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


BASELINE_KEYS = {"throughput": ("tokens_per_s", "mfu", "peak_memory_gb"),
                 "attention": ("train_ms", "train_x_softmax", "decode_ms_per_token", "decode_x_softmax")}
BASELINE_FORMATS = {"tokens_per_s": ",.0f", "mfu": ".1%"}  # the others: .2f


def baseline_of(path: Path) -> dict:
    """What --baseline compares: the measured numbers of an earlier report's rows."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--baseline {path}: {err}; give an earlier gpu_check JSON report")
    rows = {part: {name: {k: r[k] for k in keys if r.get(k) is not None}
                   for name, r in earlier.get(part, {}).items() if any(r.get(k) is not None for k in keys)}
            for part, keys in BASELINE_KEYS.items()}
    for name, row in rows["attention"].items():  # the batch its times were taken at (earlier reports: 1)
        row["batch"] = earlier["attention"][name].get("batch", 1)
    gpu = earlier.get("environment", {}).get("gpu")
    return {"path": str(path), "date": earlier.get("date"), "gpu": gpu, **rows}


def comparison(report: dict) -> list[str]:
    """Markdown lines: each number of a row measured by both this run and the --baseline run."""
    base = report["baseline"]
    lines = ["", f"Against {base['path']} ({base['date']}, {base['gpu']}): before -> now", "",
             "| row | " + " | ".join(k for keys in BASELINE_KEYS.values() for k in keys) + " |",
             "|---|" + "---|" * sum(len(keys) for keys in BASELINE_KEYS.values())]
    gpu = report["environment"].get("gpu")
    if base["gpu"] != gpu:  # e.g. an H100 run against an H200 one: memory bandwidth and clocks differ
        lines[2:2] = ["", f"Different devices ({base['gpu']} before, {gpu} now): times and tokens/s compare "
                      "the hardware as much as the code; ratios within each run (x softmax) and MFU compare "
                      "the code."]
    for part, keys in BASELINE_KEYS.items():
        for name, before in base[part].items():
            now = report.get(part, {}).get(name, {})
            if not any(k in now for k in before):
                continue
            spec = lambda k: BASELINE_FORMATS.get(k, ".2f")  # noqa: E731
            cells = [f"{before[k]:{spec(k)}} -> {now[k]:{spec(k)}}" if k in before and now.get(k) is not None
                     else "" for k in keys]
            if part == "attention" and before["batch"] != now.get("batch", 1) and cells[0]:
                cells[0] += f" (batch {before['batch']} -> {now.get('batch', 1)})"
            other = sum(len(v) for p, v in BASELINE_KEYS.items() if p != part)
            cells = cells + [""] * other if part == "throughput" else [""] * other + cells
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def unmeasured(name: str, row: dict, cells: int) -> str | None:
    """The table line of a row that was skipped or failed (`cells` columns after its name), else None."""
    why = (f"skipped: {row['skipped']}" if "skipped" in row else f"ERROR: {row['error']}" if "error" in row
           else None)
    return None if why is None else f"| {name} | {why} |" + " |" * (cells - 1)


def markdown(report: dict) -> str:
    env = report["environment"]
    versions = ", ".join(f"{name} {v['running']}" + (f" (pinned {v['pinned']})" if v["running"] != v["pinned"] else "")
                         for name, v in env["versions"].items())
    paths = ", ".join(f"{name}: {'yes' if there else 'no'}" for name, there in env["code_paths"].items())
    lines = [f"# GPU check {report['date']} on {env.get('gpu', 'unknown')}", "",
             f"CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, Python {env['python']}; {versions}", "",
             f"version-dependent code paths: {paths}", "",
             "| correctness (fp32, 3 AdamW steps) | CPU losses | device losses | |", "|---|---|---|---|"]
    for name, c in report["correctness"].items():
        if "skipped" in c:
            lines.append(f"| {name} | | | skipped: {c['skipped']} |")
        elif "error" in c:
            lines.append(f"| {name} | | | ERROR: {c['error']} |")
        else:
            fmt = lambda xs: ", ".join(f"{x:.5f}" for x in xs)  # noqa: E731
            lines.append(f"| {name} | {fmt(c['cpu'])} | {fmt(c['device'])} | {'match' if c['match'] else 'MISMATCH'} |")
    g = report.get("grouped_gemm", {"error": "not run"})
    g = {"error": "skipped: " + g["skipped"]} if "skipped" in g else g
    lines += ["", "grouped GEMM vs per-expert loop (bf16, tiny UoE, forward + backward): " + (
        f"ERROR: {g['error']}" if "error" in g else
        f"loss {g['loss_grouped']:.5f} vs {g['loss_per_expert']:.5f}, gradient relative difference "
        f"{g['grad_rel_diff']:.2e} -> {'match' if g['match'] else 'MISMATCH'}")]
    for check, title in (("relu_kernels", "Triton ReLU kernels vs the PyTorch path (fp32 against float64"),
                         ("lisa_align", "Fused LISA alignment kernel vs HeadAlign (against float64"),
                         ("lisa_flash", "Fused LISA kernel in a model vs the explicit scores (sll / rll, loss "
                          "and every gradient against float64")):
        r = report.get(check, {"error": "not run"})
        r = {"error": "skipped: " + r["skipped"]} if "skipped" in r else r
        lines += ["", f"{title}, output and gradients): " + (
            f"ERROR: {r['error']}" if "error" in r else
            ", ".join(f"{case} {err:.1e}" for case, err in r["max_rel_error"].items())
            + f" -> {'match' if r['match'] else 'MISMATCH'}")]
    d = report.get("lisa_decode", {"error": "not run"})
    d = {"error": "skipped: " + d["skipped"]} if "skipped" in d else d
    lines += ["", "Fused LISA decode kernel vs the PyTorch path (softmax, LISA, LISA; logits' error against "
              "the PyTorch path in fp32, relative to the largest; ms per step; the same model with softmax "
              "layers only): " + (
                  f"ERROR: {d['error']}" if "error" in d else
                  "; ".join(f"{case}: error fused {r.get('fused_error', float('nan')):.1e}, PyTorch "
                            f"{r.get('pytorch_error', float('nan')):.1e} "
                            f"(between them {r['max_rel_diff']:.1e}), "
                            f"fused {r['fused_ms']:.2f} ms, PyTorch "
                            f"{r['pytorch_ms']:.2f} ms ({r['fused_x_pytorch']:.2f}x), softmax-only {r['softmax_ms']:.2f} ms"
                            for case, r in d.get("rows", {}).items())
                  + f" -> {'match' if d.get('match') else 'MISMATCH'}")]
    lines += ["", "| model | params (active) | micro-batch x seq | tokens/s | TFLOP/s | MFU | peak mem GB | "
              "planned GB (plan/meas) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["throughput"].items():
        if line := unmeasured(name, r, 7):
            lines.append(line)
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        lines.append(f"| {name} | {count(r['params_total'])} ({count(r['params_active'])}) | "
                     f"{r['micro_batch']} x {r['seq']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | "
                     f"{r['peak_memory_gb']:.1f} | {r['planned_memory_gb']:.1f} ({r['plan_over_measured']:.2f}) |")
    attention = report.get("attention", {})
    if attention:
        lines += ["", "One attention layer per kind (forward + backward; decode: a softmax layer, then the "
                  "kind, with the KV cache):", "",
                  "| kind @ seq | batch | train ms | x softmax | kept MB (per sequence) | prefill ms | "
                  "decode ms/token | x softmax |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in attention.items():
            if line := unmeasured(name, r, 7):
                lines.append(line)
                continue
            fmt = lambda key, spec: format(r[key], spec) if key in r else ""  # noqa: E731
            decode = f"decode ERROR: {r['decode_error']}" if "decode_error" in r else fmt("decode_ms_per_token", ".2f")
            lines.append(f"| {name} | {r.get('batch', 1)} | {fmt('train_ms', '.2f')} | {fmt('train_x_softmax', '.2f')} | "
                         f"{fmt('kept_mb', '.1f')} | {fmt('prefill_ms', '.1f')} | {decode} | "
                         f"{fmt('decode_x_softmax', '.2f')} |")
    profiled = {name: r for name, r in report["throughput"].items() if "top_ops" in r or "profile_error" in r}
    profiled |= {f"attention {name}": r for name, r in report.get("attention", {}).items()
                 if "top_ops" in r or "profile_error" in r}
    if profiled:
        lines += ["", "Where a step's time goes (one profiled step; self time per operator, share of all):", ""]
        lines += [f"- {name}: " + (", ".join(f"{op['op']} {100 * op['share']:.0f}%" for op in r["top_ops"][:6])
                                   if "top_ops" in r else f"profile failed: {r['profile_error']}")
                  for name, r in profiled.items()]
    if report.get("baseline"):
        lines += comparison(report)
    if report.get("part_seconds"):
        seconds = report["part_seconds"].items()
        lines += ["", "Seconds per part (its process's start included): "
                  + ", ".join(f"{name.removeprefix(CHECK)} {s:.0f}" for name, s in seconds)]
    return "\n".join(lines)
