"""GPU validation: environment, CPU-vs-GPU correctness, and bf16 throughput/MFU of ~1B models.

    bash bench/gpu_check.sh            # or: python -m bench.gpu_check [--steps 10] [--families a,b]

Every part runs in a process of its own, with a timeout (a kernel fault, a hang or a leak in one
cannot spoil the next; this process never touches the GPU): the CPU-vs-GPU losses, the grouped-GEMM,
Triton ReLU and fused LISA (alignment, whole layer, decode) checks, then one process per throughput row, with
the micro-batch of its config's `# single-gpu` layout line and the measured peak memory beside the
planner's estimate, then one attention layer per kind at the 1B hybrid width, forward + backward and
decoding with the KV cache, beside softmax (--no-attention skips it; each kind's row is kept as it
finishes). The report (JSON and markdown) is rewritten after every part, so a run stopped from
outside keeps what was measured; --deadline SECONDS skips the parts that no longer fit and writes
the report in time. `--device cpu` runs the same script on tiny models in fp32: a smoke test of the
script itself, not a measurement. Without a CUDA device (and no `--device cpu`) it says so and exits
0. Writes bench/results/gpu_check-<date>.json and .md (and -profiles.txt: each row's operator table).
--baseline EARLIER.json adds a before -> now table of the rows both runs measured.
The kernel checks are in bench/gpu_kernel_checks.py, the report's markdown in bench/gpu_report.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.gpu_kernel_checks import (grouped_gemm_check, lisa_align_check, lisa_decode_check, lisa_flash_check,
                                     relu_kernel_check)
from bench.gpu_report import CHECK, baseline_of, markdown
from launch.layouts import read_layouts

FAMILIES = {  # name: (config, overrides)
    "dense-1b": ("configs/dense_1b.yaml", ["train.compile=false"]),  # its default (auto) compiles here
    "uoe-1b": ("configs/1b_uoe.yaml", ["model.moe.grouped_gemm=false"]),  # its default (auto) is grouped here
    "hybrid-1b": ("configs/hybrid_1b.yaml", []),
    # the performance switches, each against its family's row above
    "dense-1b compiled": ("configs/dense_1b.yaml", ["train.compile=true"]),
    "uoe-1b grouped-gemm": ("configs/1b_uoe.yaml", ["model.moe.grouped_gemm=true"]),
    "uoe-1b grouped-gemm compiled": ("configs/1b_uoe.yaml",
                                     ["model.moe.grouped_gemm=true", "train.compile=true"]),
    # LISA's cheap alignment: linear, its groups within grouped-query K/V groups (score features one
    # head wide, attended by flash kernels); as good as the FFN one in bench.attention_train --set lisa
    "hybrid-1b linear-gqa": ("configs/hybrid_1b.yaml", ["model.lisa.align_hidden=0", "model.num_kv_heads=4"]),
}
TINY = ["model.vocab_size=512", "model.hidden_size=128", "model.num_layers=4", "model.num_heads=4",
        "model.ffn_hidden_size=256", "model.max_seq_len=64",
        "model.moe.expert_hidden_size=64", "model.moe.shared_hidden_size=64", "model.moe.num_experts=4",
        "model.moe.top_k=2", "model.moe.routing_neurons=0", "model.lisa.keep_full_layers=2"]
TINY_HYBRID = ["model.attention=skrl"]  # softmax, softmax_sink, relu, lisa in 4 layers
# One attention layer per kind at the 1B hybrid width (configs/hybrid_1b.yaml: hidden 2048, 16 heads).
# _gqa: one K/V head, against softmax_gqa (bench.attention_speed); lisa_torch: lisa by the PyTorch path
# (query blocks) instead of the fused kernel, lisa_linear_torch (_gqa): lisa_linear (_gqa) over score
# features instead of the fused kernel; _chain: the mean per layer of two LISA layers in a row after a
# full one, as the hybrid configs place them; docs: within 4 documents (FlexAttention, Triton on GPU).
ATTENTION_KINDS = ("softmax", "softmax_gqa", "softmax_sink", "relu", "relu_torch", "lisa", "lisa_torch",
                   "lisa_chain", "lisa_ffn_naive", "lisa_linear", "lisa_linear_torch", "lisa_linear_gqa",
                   "lisa_linear_torch_gqa", "lisa_linear_chain_gqa", "softmax+publish", "softmax docs",
                   "softmax_sink docs", "relu docs", "lisa_linear docs")
ATTENTION_SEQS = (2048, 4096)
# Tokens per timed call of an attention row on the GPU (batch 8 at 2048, 4 at 4096): at batch 1 a
# softmax layer's forward + backward took 2.35 / 2.38 ms at 2048 / 4096, the cost of its launches,
# not of its work, so ratios against it said little.
ATTENTION_TOKENS = 16384
# Kinds whose forward + backward is also profiled at the first length (their top operators in the row,
# the operator table in -profiles.txt): where a LISA layer's time goes, beside its reference.
PROFILED_KINDS = ("softmax_gqa", "lisa", "lisa_torch", "lisa_linear_gqa")
ATTENTION_ROW = "attention@"  # run_isolated's name for the attention rows of one sequence length
RESULT = "RESULT "
PROFILE = "PROFILE "
ROW = "ROW "  # one attention row, printed as it finishes


def tiny(cfg_path: str) -> list[str]:
    return TINY + (TINY_HYBRID if "hybrid" in Path(cfg_path).name else [])


def single_gpu_layout(cfg_path: str) -> list[str]:
    """The overrides of the config's recommended single-GPU layout, one micro-batch per step."""
    overrides = read_layouts(cfg_path).single_gpu or []
    return [kv for kv in overrides if not kv.startswith("train.grad_accum=")]


PINNED = ("torch", "deepspeed", "megatron-core", "mosaicml-streaming", "transformers")


def environment(device: str) -> dict:
    """The machine and the versions that ran, beside requirements.txt's pins (a GPU machine may bring
    its own torch), and which version-dependent code paths are there."""
    from importlib import metadata

    pins = dict(line.split("==", 1) for line in (Path(__file__).parents[1] / "requirements.txt").read_text().split()
                if "==" in line)
    versions = {}
    for name in PINNED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "torch": torch.__version__, "device": device,
            "versions": {name: {"running": versions[name], "pinned": pins.get(name)} for name in PINNED},
            "code_paths": {"grouped-GEMM experts (torch._grouped_mm)": hasattr(torch, "_grouped_mm"),
                           "torch.compile": hasattr(torch, "compile")}}


def device_info(device: str) -> dict:
    """The device, CUDA and NCCL (queried in a part of its own: the orchestrating process never
    starts CUDA)."""
    if device != "cuda":
        return {"gpu": f"cpu ({platform.processor() or platform.machine()})"}
    info = {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
            "memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as err:  # noqa: BLE001 - reported, not fatal
        info["nccl"] = f"unavailable ({err})"
    return info


def tiny_losses(cfg_path: str, overrides: list[str], device: str, steps: int = 3) -> list[float]:
    """fp32 AdamW steps of a tiny model on one fixed batch (no DeepSpeed: the same code on both devices)."""
    from models.gpt import GPT
    from pretrain.config import load_config

    torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 on the GPU too, or CPU and GPU differ
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config(cfg_path, overrides + tiny(cfg_path) + ["parallel.expert=1", "model.moe.grouped_gemm=false",
                                                    "train.compile=false"])
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


def throughput(name: str, steps: int, device: str, micro_batch: int | None, profile_dir: Path | None = None) -> None:
    """Train steps of one family through the DeepSpeed engine (ZeRO-1, one process) and print the
    row's RESULT line. With `profile_dir`, one more step then runs under torch.profiler and a PROFILE
    line follows (its top operators; the full operator table is appended to
    profile_dir/<report stem>-profiles.txt): a profiler failure cannot cost the row its numbers."""
    from launch.plan import GPUS, plan
    from models.counting import flops_per_token, param_counts
    from models.gpt import GPT
    from pretrain.config import load_config, switched_on
    from pretrain.distributed import init_single_process
    from pretrain.engine import build_engine
    from pretrain.telemetry import device_peak_tflops, peak_memory_gb

    cuda = device == "cuda"
    cfg_path, overrides = FAMILIES[name]
    overrides = single_gpu_layout(cfg_path) + overrides + ["parallel.tensor=1", "parallel.expert=1",
                                                           "parallel.zero_stage=1", "train.grad_accum=1",
                                                           "train.steps=1000", "train.warmup_steps=10"]
    overrides += ["train.precision=bf16"] if cuda else tiny(cfg_path) + ["train.precision=fp32"]
    if micro_batch:
        overrides.append(f"train.micro_batch={micro_batch}")
    cfg = load_config(cfg_path, overrides)
    init_single_process("nccl" if cuda else "gloo")  # every tensor here lives on the device
    torch.manual_seed(0)
    model = GPT(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing)
    if switched_on(cfg.train.compile):
        model.compile_blocks()
    engine = build_engine(cfg, model)
    micro, seq = cfg.train.micro_batch, cfg.model.max_seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), device=engine.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> torch.Tensor:
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.module.after_optimizer_step()  # as the trainer does (router-bias updates)
        return loss

    started = time.perf_counter()
    first_loss = step().item()  # warm-up (compilation, allocator, autotuning): three steps
    for _ in range(2):
        step()
    sync()
    warmup_s = time.perf_counter() - started
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    elapsed = (time.perf_counter() - start) / steps
    tokens = micro * seq
    counts = param_counts(cfg.model)
    tflops = tokens * flops_per_token(cfg.model) / elapsed / 1e12
    peak = device_peak_tflops()
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 1e6
    # the planner's GPU of that name, else of that generation (grouped_gemm=auto depends on it)
    gpu = "cpu"
    if cuda:
        device_name, hopper = torch.cuda.get_device_name().lower(), torch.cuda.get_device_capability()[0] == 9
        gpu = next((g for g in GPUS if g in device_name), "h100" if hopper else "a100")
    planned = plan(cfg, 1, 1, memory_gb, gpu, bf16=cuda)
    measured = peak_memory_gb()
    row = {"params_total": counts["total"], "params_active": counts["active"], "seq": seq,
           "micro_batch": micro, "checkpointing": cfg.train.activation_checkpointing, "warmup_s": warmup_s,
           "step_s": elapsed, "tokens_per_s": tokens / elapsed, "tflops": tflops,
           "mfu": tflops / peak if peak else None, "peak_memory_gb": measured,
           "planned_memory_gb": planned["memory_total_gb"],
           "plan_over_measured": planned["memory_total_gb"] / measured,
           "first_loss": first_loss, "final_loss": loss.item()}  # one batch, repeated: how fast it is learnt
    print(RESULT + json.dumps(row), flush=True)
    if profile_dir is None:
        return
    from pretrain.profiling import operator_table, top_operators

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
            step()
            sync()
        profile_dir.mkdir(parents=True, exist_ok=True)
        with open(profile_dir / f"{report_stem(device)}-profiles.txt", "a") as f:  # one file for every row
            f.write(f"===== {name} =====\n{operator_table(prof)}\n")
        profiled = {"top_ops": top_operators(prof)}
    except Exception as err:  # noqa: BLE001 - the row keeps its numbers
        profiled = {"profile_error": f"{type(err).__name__}: {err}"}
    print(PROFILE + json.dumps(profiled), flush=True)


def attention_seqs(device: str) -> tuple[int, ...]:
    return (64,) if device == "cpu" else ATTENTION_SEQS


def profile_attention(kind: str, hidden: int, heads: int, seq: int, batch: int, dev: torch.device,
                      dtype: torch.dtype, profile_dir: Path) -> list[dict]:
    """One forward + backward of an attention layer under torch.profiler (after one unprofiled):
    its top operators; the operator table is appended to profile_dir/<report stem>-profiles.txt."""
    from bench.attention_speed import layer_and_inputs
    from pretrain.profiling import operator_table, top_operators

    module, (x, q, k), ctx = layer_and_inputs(kind, hidden, heads, seq, batch, dev, None, dtype)
    cuda = dev.type == "cuda"

    def once() -> None:
        module(x, ctx()).sum().backward()
        if cuda:
            torch.cuda.synchronize()

    once()
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU] + ([activity.CUDA] if cuda else [])) as prof:
        once()
    profile_dir.mkdir(parents=True, exist_ok=True)
    with open(profile_dir / f"{report_stem(dev.type)}-profiles.txt", "a") as f:
        f.write(f"===== attention {kind} @ {seq} =====\n{operator_table(prof)}\n")
    return top_operators(prof)


def attention_rows(device: str, seq: int, profile_dir: Path | None = None) -> None:
    """Forward + backward of one attention layer per kind (bf16 on the GPU) and decoding with the KV
    cache (a softmax layer, then the kind), at sequence `seq`; each kind's ROW line is printed as it
    finishes (a timeout keeps the rows before it). With `profile_dir`, PROFILED_KINDS are profiled
    at the first length. --device cpu: tiny sizes in fp32, a smoke test."""
    from bench.attention_speed import DECODE_LAYERS, decode_ms_per_token, kept_bytes, time_kind

    cpu = device == "cpu"
    dev, dtype = torch.device(device), torch.float32 if cpu else torch.bfloat16
    hidden, heads = (128, 4) if cpu else (2048, 16)
    batch = 1 if cpu else max(1, ATTENTION_TOKENS // seq)
    documents = (torch.arange(seq, device=dev) * 4 // seq)[None]
    for kind in ATTENTION_KINDS:
        row = {"kind": kind, "seq": seq, "batch": batch}
        base_kind = kind.removesuffix(" docs")
        docs = documents.expand(batch, seq).contiguous() if kind.endswith(" docs") else None
        try:
            row["train_ms"] = 1000 * time_kind(base_kind, hidden, heads, seq, batch, 5, dev, docs, dtype=dtype)
            # per sequence: what a layer keeps for backward at batch 1
            row["kept_mb"] = kept_bytes(base_kind, hidden, heads, seq, 1, dev, None if docs is None else docs[:1],
                                        dtype=dtype) / 2**20
        except Exception as err:  # noqa: BLE001 - reported in the table, the other rows still run
            row["error"] = f"{type(err).__name__}: {err}"
        if kind in DECODE_LAYERS:
            try:
                row.update(decode_ms_per_token(kind, hidden, heads, seq, 16 if cpu else 64, dev, dtype))
            except Exception as err:  # noqa: BLE001 - the training numbers stay
                row["decode_error"] = f"{type(err).__name__}: {err}"
        if profile_dir is not None and kind in PROFILED_KINDS and seq == attention_seqs(device)[0]:
            try:
                row["top_ops"] = profile_attention(base_kind, hidden, heads, seq, batch, dev, dtype, profile_dir)
            except Exception as err:  # noqa: BLE001 - the row keeps its numbers
                row["profile_error"] = f"{type(err).__name__}: {err}"
        print(ROW + json.dumps(row), flush=True)


def with_ratios(rows: dict, seq: int) -> dict:
    """Each attention row's training and decode time over softmax's (softmax_gqa's for _gqa kinds)."""
    for row in rows.values():
        base = rows.get(f"softmax_gqa @ {seq}" if row["kind"].endswith("_gqa") else f"softmax @ {seq}", {})
        if "train_ms" in row and "train_ms" in base:
            row["train_x_softmax"] = row["train_ms"] / base["train_ms"]
        if "decode_ms_per_token" in row and "decode_ms_per_token" in base:
            row["decode_x_softmax"] = row["decode_ms_per_token"] / base["decode_ms_per_token"]
    return rows


def correctness(device: str, names: list[str]) -> dict:
    """CPU and device losses of each family's tiny fp32 model (the switch rows share their family's)."""
    result = {}
    for name in names:
        cfg_path, overrides = FAMILIES[name]
        if name.split()[0] in result:
            continue
        try:
            cpu, dev = tiny_losses(cfg_path, overrides, "cpu"), tiny_losses(cfg_path, overrides, device)
        except Exception as err:  # noqa: BLE001 - reported in the table, the other families still run
            result[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        result[name] = {"cpu": cpu, "device": dev,
                        "match": all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(cpu, dev))}
    return result


# Each a part of its own, in this order, after device_info.
CHECKS = {"correctness": None, "grouped_gemm": grouped_gemm_check, "relu_kernels": relu_kernel_check,
          "lisa_align": lisa_align_check, "lisa_flash": lisa_flash_check, "lisa_decode": lisa_decode_check}
# Triton kernel checks: with --device cpu their process runs under Triton's interpreter, which Triton
# reads when it is imported, so it is set in the environment the process starts with.
TRITON_CHECKS = ("relu_kernels", "lisa_align", "lisa_flash", "lisa_decode")


def interpreted(name: str, device: str) -> bool:
    return device == "cpu" and name.removeprefix(CHECK) in TRITON_CHECKS


def run_isolated(name: str, args: argparse.Namespace, timeout: float) -> dict:
    """One part (a check, a throughput row, the attention rows of one length) in a fresh process; a
    crash or timeout becomes its error, and the attention rows printed before it are kept."""
    from pretrain.distributed import environment_for_child

    cmd = [sys.executable, "-m", "bench.gpu_check", "--one", name, "--steps", str(args.steps),
           "--device", args.device, "--families", args.families]
    if args.micro_batch:
        cmd += ["--micro-batch", str(args.micro_batch)]
    cmd += ["--out-dir", args.out_dir, "--profile" if args.profile else "--no-profile"]
    env = environment_for_child()
    if interpreted(name, args.device):
        env["TRITON_INTERPRET"] = "1"
    # Its output goes to files under --out-dir as it is printed: a run killed from outside keeps the
    # rows its running part had finished (and how far it got).
    logs = Path(args.out_dir) / f"{report_stem(args.device)}-parts"
    logs.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    with open(logs / f"{stem}.out", "w") as out_file, open(logs / f"{stem}.err", "w") as err_file:
        try:
            out = subprocess.run(cmd, stdout=out_file, stderr=err_file, text=True, timeout=timeout, env=env)
            failure = f"exit {out.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
    stdout, stderr = ((logs / f"{stem}.{kind}").read_text(errors="replace") for kind in ("out", "err"))
    lines = stdout.splitlines()
    tail = [line for line in (stderr + stdout).splitlines() if line.strip()][-40:]
    error = {"error": f"{failure}: {tail[-1] if tail else 'no output'}", "log_tail": tail}
    rows = [json.loads(line[len(ROW):]) for line in lines if line.startswith(ROW)]
    if name.startswith(ATTENTION_ROW):
        seq = int(name.removeprefix(ATTENTION_ROW))
        done = {f"{r['kind']} @ {seq}": r for r in rows}
        missing = [k for k in ATTENTION_KINDS if f"{k} @ {seq}" not in done]
        for kind in missing[:1]:  # the kind it was timing when it stopped; the rest never ran
            done[f"{kind} @ {seq}"] = {"kind": kind, "seq": seq, **error}
        for kind in missing[1:]:
            done[f"{kind} @ {seq}"] = {"kind": kind, "seq": seq, "error": "not run: the process ended before it"}
        return with_ratios(done, seq)
    row = next((json.loads(line[len(RESULT):]) for line in lines if line.startswith(RESULT)), None)
    if row is None:
        return error
    profiled = next((json.loads(line[len(PROFILE):]) for line in lines if line.startswith(PROFILE)), None)
    if args.profile and not name.startswith(CHECK):
        row.update(profiled or {"profile_error": f"{failure} while profiling"})
    return row


class Deadline:
    """--deadline: the seconds a part may take, what is left of the run's time (less a reserve for
    the report), at most its own limit; None once no part fits any more."""

    RESERVE_S, MIN_PART_S = 10, 30

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds if seconds else None

    def budget(self, limit: float) -> float | None:
        if self.end is None:
            return limit
        left = self.end - time.monotonic() - self.RESERVE_S
        return min(limit, left) if left >= self.MIN_PART_S else None


def report_stem(device: str) -> str:
    return f"gpu_check-{datetime.date.today().isoformat()}" + ("-cpu-smoke" if device == "cpu" else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (after 3 warm-up steps)")
    parser.add_argument("--micro-batch", type=int, help="override every row's micro-batch")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of: {', '.join(FAMILIES)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: tiny fp32 models, a smoke test of this script")
    parser.add_argument("--row-timeout", type=int, default=300,
                        help="seconds per throughput row, and per sequence length of the attention rows")
    parser.add_argument("--check-timeout", type=int, default=150, help="seconds per correctness or kernel check")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run, of: {', '.join(CHECKS)} (the others are skipped)")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds the whole check may take (0: no limit); parts that no longer fit are "
                             "skipped, and the report is written in time")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile one more step after each row's timed steps (top operators in the report)")
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True,
                        help="time one attention layer per kind, training and decoding")
    parser.add_argument("--baseline", type=Path, help="an earlier run's JSON report: a before -> now table")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        parser.error(f"--checks: no check named {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device found: nothing measured (this check needs a GPU)")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.one:
        from pretrain.distributed import destroy_distributed, init_single_process

        if args.one.startswith(ATTENTION_ROW):
            init_single_process()
            attention_rows(args.device, int(args.one.removeprefix(ATTENTION_ROW)),
                           Path(args.out_dir) if args.profile else None)
        elif args.one.startswith(CHECK):
            if interpreted(args.one, args.device) and os.environ.get("TRITON_INTERPRET") != "1":
                parser.error(f"--one {args.one} --device cpu runs under Triton's interpreter: "
                             "set TRITON_INTERPRET=1")
            init_single_process()  # the tiny models build megatron-core layers
            check = args.one.removeprefix(CHECK)
            result = (correctness(args.device, args.families.split(",")) if check == "correctness"
                      else device_info(args.device) if check == "device_info" else CHECKS[check](args.device))
            print(RESULT + json.dumps(result), flush=True)
        else:
            profile_dir = Path(args.out_dir) if args.profile else None
            throughput(args.one, args.steps, args.device, args.micro_batch, profile_dir)
        destroy_distributed()
        return 0
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    deadline = Deadline(args.deadline)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = report_stem(args.device)
    (out / f"{stem}-profiles.txt").unlink(missing_ok=True)  # the rows append to it
    report = {"date": datetime.date.today().isoformat(), "environment": environment(args.device),
              "correctness": {}, "throughput": {}, "part_seconds": {}}
    if args.attention:
        report["attention"] = {}
    if args.baseline:  # read now: a missing or unreadable file fails before any GPU time is spent
        report["baseline"] = baseline_of(args.baseline)

    def save() -> None:  # after every part: a run stopped from outside keeps what was measured
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (out / f"{stem}.md").write_text(markdown(report) + "\n")

    def part(name: str, limit: float) -> dict:
        budget = deadline.budget(limit)
        if budget is None:
            return {"skipped": f"--deadline {args.deadline} s reached"}
        start = time.monotonic()
        result = run_isolated(name, args, budget)
        report["part_seconds"][name] = round(time.monotonic() - start, 1)  # to size the next run's --deadline
        return result

    info = part(CHECK + "device_info", 60)
    report["environment"].update({k: v for k, v in info.items() if k != "log_tail"} if "gpu" in info
                                 else {"gpu": f"unknown ({info.get('error') or info.get('skipped')})"})
    print(json.dumps(report["environment"], indent=1), flush=True)
    save()
    for check in CHECKS:
        chosen = check in args.checks.split(",")
        result = part(CHECK + check, args.check_timeout) if chosen else {"skipped": "not in --checks"}
        if check == "correctness":
            report["correctness"] = result if not {"error", "skipped"} & set(result) else {"all": result}
        else:
            report[check] = result
        print(f"{check}: {json.dumps({k: v for k, v in result.items() if k != 'log_tail'})}", flush=True)
        save()
    # In this order, so that a --deadline drops the last parts: the families, the attention kinds at
    # the first length (2048, where the kernels' goals are set), the families' switch rows (compile,
    # grouped GEMM, another alignment), then the other lengths.
    seqs = list(attention_seqs(args.device)) if args.attention else []
    base, switches = [n for n in names if " " not in n], [n for n in names if " " in n]
    for item in [*base, *seqs[:1], *switches, *seqs[1:]]:
        if isinstance(item, str):
            report["throughput"][item] = part(item, args.row_timeout)
            print(item, json.dumps({k: v for k, v in report["throughput"][item].items() if k != "log_tail"}), flush=True)
        else:
            rows = part(f"{ATTENTION_ROW}{item}", args.row_timeout)
            rows = rows if not {"error", "skipped"} & set(rows) else {f"all @ {item}": {"kind": "all", "seq": item, **rows}}
            report["attention"].update(rows)
            for name, row in rows.items():
                print(f"attention {name}: {json.dumps({k: v for k, v in row.items() if k != 'log_tail'})}", flush=True)
        save()
    report["throughput"] = {name: report["throughput"][name] for name in names}  # the order asked for
    print(markdown(report))
    # What ran and failed (parts a --deadline skipped are listed apart).
    failed = [f"{n} (correctness)" for n, c in report["correctness"].items()
              if not c.get("match") and "skipped" not in c]
    failed += [f"{n} (throughput)" for n, r in report["throughput"].items() if "error" in r]
    kernel_checks = (("grouped_gemm", "grouped GEMM"), ("relu_kernels", "Triton ReLU kernels"),
                     ("lisa_align", "fused LISA alignment"), ("lisa_flash", "fused LISA"),
                     ("lisa_decode", "fused LISA decode"))
    failed += [name for check, name in kernel_checks
               if not report[check].get("match") and "skipped" not in report[check]]
    parts = [*report["throughput"].items(), *report.get("attention", {}).items(),
             *((c, report[c]) for c in CHECKS if c != "correctness")]
    for why in ("--deadline", "--checks"):
        skipped = [name for name, r in parts if why in r.get("skipped", "")]
        if skipped:
            print(f"skipped ({why}): {', '.join(skipped)}", flush=True)
    failed += [f"attention {n}" for n, r in report.get("attention", {}).items() if "error" in r or "decode_error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    print(f"wrote {out / stem}.json and .md", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
