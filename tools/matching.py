"""The matched UoE / MoE+shared / dense size presets (models.moe.matching) and the YAML configs
written from them.

    python -m tools.matching                  # print the table for every preset
    python -m tools.matching --write configs  # (re)write configs/{preset}_{uoe,moe,moe_dense}.yaml

The dense twin is written as {preset}_moe_dense.yaml, except for "tiny" whose dense twin is the
existing configs/tiny_dense.yaml (same model; a test checks it). Size presets also get the two layout
lines every size config carries: the 8x80 GB-node layout the file sets, and the single-GPU overrides
(`single_gpu` below, the same for all three kinds; tests/test_plan.py checks both with the planner).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from launch.layouts import NODES_PREFIX, SINGLE_GPU_PREFIX
from models.config import ModelConfig
from models.moe.matching import matched_models, parity
from tools.cli import ToolError, argument_parser, reports_errors, run

# Presets: (model fields, sparse shape, parallel / train hints). Sizes are total parameters of the
# sparse models with a 32k vocabulary (untied); active sizes are printed by `main`.
PRESETS = {
    "tiny": dict(model=dict(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128),
                 sparse=dict(num_experts=4, top_k=2, expert_hidden_size=128, shared_hidden_size=96),
                 parallel=dict(expert=2, zero_stage=2),
                 train=dict(steps=300, micro_batch=8, lr=2.0e-3, warmup_steps=30, log_interval=10,
                            eval_interval=50, save_interval=100),
                 data=dict(shards="data/demo/shards", tokenizer="data/demo/tokenizer")),
    "125m": dict(model=dict(vocab_size=32000, hidden_size=640, num_layers=8, num_heads=10, max_seq_len=2048),
                 sparse=dict(num_experts=8, top_k=2, expert_hidden_size=512, shared_hidden_size=512),
                 parallel=dict(expert=8, zero_stage=1),
                 train=dict(steps=20000, micro_batch=16, lr=1.0e-3, warmup_steps=1000),
                 single_gpu=dict(zero_stage=2, micro_batch=32, grad_accum=4)),
    "350m": dict(model=dict(vocab_size=32000, hidden_size=1024, num_layers=12, num_heads=16, max_seq_len=2048),
                 sparse=dict(num_experts=8, top_k=2, expert_hidden_size=768, shared_hidden_size=768),
                 parallel=dict(expert=8, zero_stage=1),
                 train=dict(steps=30000, micro_batch=16, lr=8.0e-4, warmup_steps=1000),
                 single_gpu=dict(zero_stage=2, micro_batch=32, grad_accum=4)),
    "1b": dict(model=dict(vocab_size=32000, hidden_size=1536, num_layers=16, num_heads=16, max_seq_len=2048),
               sparse=dict(num_experts=16, top_k=2, expert_hidden_size=768, shared_hidden_size=768),
               parallel=dict(expert=8, zero_stage=1),
               train=dict(steps=50000, micro_batch=8, lr=6.0e-4, warmup_steps=2000),
               single_gpu=dict(zero_stage=2, micro_batch=16, grad_accum=4)),
    # Fine-grained: 64 experts, top-8, expert width d/2, N_s = 768 / 64 = 12 routing neurons.
    "3b": dict(model=dict(vocab_size=32000, hidden_size=1536, num_layers=12, num_heads=16, max_seq_len=2048),
               sparse=dict(num_experts=64, top_k=8, expert_hidden_size=768, shared_hidden_size=768),
               parallel=dict(expert=8, zero_stage=1),
               train=dict(steps=100000, micro_batch=8, lr=4.0e-4, warmup_steps=2000),
               single_gpu=dict(zero_stage=2, micro_batch=4, grad_accum=16)),
}


def preset_models(name: str) -> dict[str, ModelConfig]:
    p = PRESETS[name]
    s = p["sparse"]
    return matched_models(ModelConfig(**p["model"]), s["num_experts"], s["top_k"], s["expert_hidden_size"],
                          s["shared_hidden_size"])


def preset_yaml(name: str, kind: str) -> dict:
    p = PRESETS[name]
    cfg = preset_models(name)[kind]
    model = {k: v for k, v in cfg.to_dict().items() if k not in ("relu_attention", "lisa", "plugins")}
    if kind == "dense":
        model.pop("moe")
    parallel = dict(tensor=1, **p["parallel"])
    if kind == "dense":
        parallel["expert"] = 1
    run_name = f"{name}-{kind}"
    return {"run": {"name": run_name, "dir": f"runs/{run_name}"}, "model": model,
            "data": p.get("data", {"shards": "data/shards", "tokenizer": "data/tokenizer"}),
            "parallel": parallel, "train": p["train"]}


LAYOUT_KEYS = ("parallel.tensor", "parallel.expert", "parallel.zero_stage",
               "train.micro_batch", "train.grad_accum", "train.activation_checkpointing")


def layout_lines(name: str, kind: str) -> str:
    """Header lines of a size preset: the 8x80 GB-node layout the file sets, then the single-GPU overrides."""
    p = PRESETS[name]
    if "single_gpu" not in p:
        return ""
    doc = preset_yaml(name, kind)
    multi = {f"parallel.{k}": v for k, v in doc["parallel"].items()}
    train = doc["train"]
    multi.update({"train.micro_batch": train["micro_batch"], "train.grad_accum": train.get("grad_accum", 1),
                  "train.activation_checkpointing": train.get("activation_checkpointing", "none")})
    s = p["single_gpu"]
    single = {"parallel.tensor": 1, "parallel.expert": 1, "parallel.zero_stage": s["zero_stage"],
              "train.micro_batch": s["micro_batch"], "train.grad_accum": s["grad_accum"],
              "train.activation_checkpointing": s.get("activation_checkpointing", "none")}

    def text(values: dict) -> str:
        return " ".join(f"{k}={str(values[k]).lower()}" for k in LAYOUT_KEYS)

    return f"{NODES_PREFIX}1 {text(multi)}\n{SINGLE_GPU_PREFIX}{text(single)}\n"


def write_configs(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PRESETS:
        table = parity(preset_models(name))
        for kind in ("uoe", "moe", "dense"):
            if name == "tiny" and kind == "dense":
                continue  # configs/tiny_dense.yaml is the dense twin
            c = table[kind]
            header = (f"# {name} {kind}: matched UoE / MoE+shared / dense set (python -m tools.matching).\n"
                      f"# {c['total'] / 1e6:.1f}M parameters, {c['active'] / 1e6:.1f}M active, "
                      f"{c['flops_per_token'] / 1e9:.2f} GFLOP/token (training).\n"
                      + layout_lines(name, kind))
            if name == "tiny":
                header += "# CPU demo and tests: parallel.expert=2 needs 2 processes (torchrun --nproc-per-node 2).\n"
            path = out_dir / f"{name}_{'moe_dense' if kind == 'dense' else kind}.yaml"
            path.write_text(header + yaml.safe_dump(preset_yaml(name, kind), sort_keys=False))
            written.append(path)
    return written


@reports_errors()
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--write", metavar="DIR", help="write the YAML configs into DIR")
    args = parser.parse_args(argv)
    if args.write and Path(args.write).exists() and not Path(args.write).is_dir():
        raise ToolError(f"--write {args.write} is a file: give a directory (the configs are written into it)")
    for name in PRESETS:
        table = parity(preset_models(name))
        for kind in ("uoe", "moe", "dense"):
            c = table[kind]
            print(f"{name:>5} {kind:>5}: total {c['total'] / 1e6:9.1f}M  active {c['active'] / 1e6:8.1f}M  "
                  f"{c['flops_per_token'] / 1e9:7.3f} GFLOP/token")
        diff = table["uoe_minus_moe"]
        print(f"{name:>5} uoe-moe: params {diff['total']:+d} (routers {diff['routers']}), "
              f"FLOPs/token {diff['flops_per_token']:+.0f}")
    if args.write:
        for path in write_configs(Path(args.write)):
            print("wrote", path)
    return 0


if __name__ == "__main__":
    run(main)
