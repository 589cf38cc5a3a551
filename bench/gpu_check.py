"""GPU validation: environment, CPU-vs-GPU correctness, and bf16 throughput/MFU of ~1B models.

    bash bench/gpu_check.sh            # or: python -m bench.gpu_check [--steps 10] [--quick]

Without a CUDA device it says so and exits 0. Writes bench/results/gpu_check-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

FAMILIES = {  # name: (config, overrides)
    "dense-1b": ("configs/dense_1b.yaml", []),
    "uoe-1b": ("configs/1b_uoe.yaml", ["parallel.expert=1"]),
    "hybrid-1b": ("configs/hybrid_1b.yaml", []),
    # the performance switches, each against its family's row above
    "dense-1b compiled": ("configs/dense_1b.yaml", ["train.compile=true"]),
    "uoe-1b grouped-gemm": ("configs/1b_uoe.yaml", ["parallel.expert=1", "model.moe.grouped_gemm=true"]),
}
TINY = ["model.vocab_size=512", "model.hidden_size=128", "model.num_layers=4", "model.num_heads=4",
        "model.ffn_hidden_size=256", "model.max_seq_len=64", "model.moe.expert_hidden_size=64",
        "model.moe.shared_hidden_size=64", "model.moe.num_experts=4", "model.moe.top_k=2",
        "model.moe.routing_neurons=0", "model.lisa.keep_full_layers=2"]


def environment() -> dict:
    import deepspeed

    env = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as err:  # noqa: BLE001 - reported, not fatal
        env["nccl"] = f"unavailable ({err})"
    env["memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return env


def tiny_losses(cfg_path: str, overrides: list[str], device: str, steps: int = 3) -> list[float]:
    """fp32 AdamW steps of a tiny model on one fixed batch (no DeepSpeed: the same code on both devices)."""
    from models.gpt import GPT
    from pretrain.config import load_config

    cfg = load_config(cfg_path, overrides + TINY + ["parallel.expert=1"])
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for _ in range(steps):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def throughput(cfg_path: str, overrides: list[str], steps: int, micro_batch: int) -> dict:
    from models.counting import flops_per_token, param_counts
    from models.gpt import GPT
    from pretrain.config import load_config
    from pretrain.engine import build_engine
    from pretrain.telemetry import device_peak_tflops

    cfg = load_config(cfg_path, overrides + [f"train.micro_batch={micro_batch}", "train.precision=bf16",
                                             "parallel.zero_stage=1", "train.steps=1000", "train.warmup_steps=10"])
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = GPT(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing).cuda()
    if cfg.train.compile:
        model.compile_blocks()
    engine = build_engine(cfg, model)
    seq = cfg.model.max_seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq + 1), device="cuda")

    def step():
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    tokens = micro_batch * seq
    counts = param_counts(cfg.model)
    tflops = tokens * flops_per_token(cfg.model) / elapsed / 1e12
    peak = device_peak_tflops()
    result = {"params_total": counts["total"], "params_active": counts["active"], "seq": seq,
              "micro_batch": micro_batch, "step_s": elapsed, "tokens_per_s": tokens / elapsed, "tflops": tflops,
              "mfu": tflops / peak if peak else None, "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
              "final_loss": loss.item()}
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device found: nothing measured (this check needs a GPU)")
        return 0
    os.environ.setdefault("MASTER_PORT", "29561")
    from pretrain.distributed import init_distributed

    init_distributed()
    report = {"date": datetime.date.today().isoformat(), "environment": environment(), "correctness": {},
              "throughput": {}}
    print(json.dumps(report["environment"], indent=1))
    for name in args.families.split(","):
        cfg_path, overrides = FAMILIES[name]
        cpu, gpu = tiny_losses(cfg_path, overrides, "cpu"), tiny_losses(cfg_path, overrides, "cuda")
        ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(cpu, gpu))
        report["correctness"][name] = {"cpu": cpu, "gpu": gpu, "match": ok}
        print(f"{name}: CPU {cpu} GPU {gpu} -> {'match' if ok else 'MISMATCH'}")
    for name in args.families.split(","):
        cfg_path, overrides = FAMILIES[name]
        report["throughput"][name] = throughput(cfg_path, overrides, args.steps, args.micro_batch)
        print(name, json.dumps(report["throughput"][name]))
    lines = [f"# GPU check {report['date']} on {report['environment']['gpu']}", "",
             "| model | params (active) | tokens/s | TFLOP/s | MFU | peak mem GB |", "|---|---|---|---|---|---|"]
    for name, r in report["throughput"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        lines.append(f"| {name} | {r['params_total'] / 1e9:.2f}B ({r['params_active'] / 1e9:.2f}B) | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {r['peak_memory_gb']:.1f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check-{report['date']}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    return 0 if all(c["match"] for c in report["correctness"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
