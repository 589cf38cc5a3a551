"""Planner memory estimate vs measured peak memory of real training steps (CPU, fp32).

    python -m bench.memory_plan [--steps 3]

Each size runs in a fresh process: resident memory before the model is built is the baseline,
the peak after a few DeepSpeed steps minus the baseline is the measurement. Prints a table and
writes bench/results/memory_plan.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SIZES = {  # name: (hidden, layers, heads, kv_heads, ffn, seq, micro_batch)
    "h256-l4": (256, 4, 4, 4, 704, 256, 8),
    "h512-l8": (512, 8, 8, 8, 1408, 256, 8),
    "h512-l8-gqa": (512, 8, 8, 2, 1408, 256, 8),
    "h512-l8-ckpt": (512, 8, 8, 8, 1408, 256, 8),
    "h512-l8-sel": (512, 8, 8, 8, 1408, 256, 8),
    "h768-l8-ckpt": (768, 8, 12, 12, 2048, 512, 8),
    "h512-l8-hybrid": (512, 8, 8, 8, 1408, 512, 4),
    "h512-l8-hybrid-naive": (512, 8, 8, 8, 1408, 512, 4),
    "h512-l8-hybrid-keep": (512, 8, 8, 8, 1408, 512, 4),
    "h512-l8-uoe": (512, 8, 8, 8, 1408, 256, 8),
}
# Hybrid attention as in configs/hybrid_*.yaml (LISA with the FFN alignment in groups of 4): its
# scores built by query blocks (kernel auto), also with the LISA chains' scores kept (keep), or
# explicit (naive).
HYBRID = {"h512-l8-hybrid": "auto", "h512-l8-hybrid-naive": "naive", "h512-l8-hybrid-keep": "auto"}


def measurement_env() -> dict:
    """A fixed mmap threshold makes freed tensors leave resident memory at once, so the peak
    resident size tracks live tensors instead of the allocator's fragmentation. Without this
    process's rendezvous variables: the measured process starts a process group of its own."""
    from pretrain.distributed import environment_for_child

    return {**environment_for_child(), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(field)


def measure(name: str, steps: int) -> dict:
    import torch

    from launch.plan import plan
    from models.config import ModelConfig
    from models.gpt import GPT
    from pretrain.config import Config
    from pretrain.distributed import init_single_process
    from pretrain.engine import build_engine

    hidden, layers, heads, kv_heads, ffn, seq, micro = SIZES[name]
    init_single_process()
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=4096, hidden_size=hidden, num_layers=layers, num_heads=heads,
                            num_kv_heads=kv_heads, ffn_hidden_size=ffn, max_seq_len=seq)
    cfg.train.micro_batch, cfg.train.steps, cfg.train.warmup_steps = micro, 100, 1
    cfg.train.activation_checkpointing = {"ckpt": "full", "sel": "selective"}.get(name.rsplit("-", 1)[-1], "none")
    if name.endswith("-uoe"):  # 8 experts of 384 neurons (48 of them routing neurons), top-2
        cfg.model.mlp = "uoe"
        moe = cfg.model.moe
        moe.num_experts, moe.top_k, moe.expert_hidden_size, moe.routing_neurons = 8, 2, 384, 48
    if name in HYBRID:
        cfg.model.attention = "sskllrll"
        cfg.model.lisa.align_group, cfg.model.lisa.kernel = 4, HYBRID[name]
        cfg.model.lisa.keep_chain_scores = name.endswith("-keep")
    estimate = plan(cfg, 1, 1, 1e6, "cpu", bf16=False)
    baseline = rss_kib("VmRSS")
    torch.manual_seed(0)
    engine = build_engine(cfg, GPT(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing))
    for _ in range(steps):
        batch = torch.randint(0, 4096, (micro, seq + 1))
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
    peak = (rss_kib("VmHWM") - baseline) / 2**20
    return {"size": name, "measured_gb": peak, "estimated_gb": estimate["memory_total_gb"],
            "ratio": estimate["memory_total_gb"] / peak, "breakdown_gb": estimate["memory_gb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results/memory_plan.json")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.steps)))
        return
    from bench.provenance import provenance

    env = measurement_env()
    meta = {"steps": args.steps, **provenance("bench.memory_plan"),
            **{key: env[key] for key in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows, failed = [], {}
    for name in SIZES:  # each in its own process (a fresh peak); the file is rewritten after each
        out = subprocess.run([sys.executable, "-m", "bench.memory_plan", "--one", name, "--steps", str(args.steps)],
                             capture_output=True, text=True, env=env)
        result = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
        if out.returncode or result is None:
            failed[name] = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
            print(f"{name}: failed ({failed[name]})", flush=True)
        else:
            rows.append(json.loads(result[7:]))
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "failed": failed}, indent=1))
    print(f"{'size':<14}{'measured GB':>12}{'estimate GB':>12}{'est/meas':>10}")
    for r in rows:
        print(f"{r['size']:<14}{r['measured_gb']:>12.3f}{r['estimated_gb']:>12.3f}{r['ratio']:>10.2f}")
    if failed:
        raise SystemExit(f"{len(failed)} size(s) failed: {', '.join(failed)} (see {args.out})")


if __name__ == "__main__":
    main()
