"""Console progress lines, TensorBoard scalars, throughput, TFLOP/s and MFU."""

from __future__ import annotations

import contextlib
import json
import resource
import time
from pathlib import Path

import torch

# Dense bf16 peak TFLOP/s per device (vendor datasheets), matched as a substring of the CUDA
# device name, first match wins: the specific variants come before their family.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200 NVL": 835.0, "H200": 989.0, "A100": 312.0,
               "L40S": 362.0, "A10G": 70.0}
# The same for fp32 runs: plain fp32 arithmetic (torch leaves TF32 off for matmuls by default).
FP32_PEAK_TFLOPS = {"H100 PCIe": 51.0, "H100 NVL": 60.0, "H100": 67.0, "H200 NVL": 60.0, "H200": 67.0, "A100": 19.5,
                    "L40S": 91.6, "A10G": 31.2}


def peak_tflops(device_name: str, bf16: bool = True) -> float | None:
    table = PEAK_TFLOPS if bf16 else FP32_PEAK_TFLOPS
    return next((peak for key, peak in table.items() if key.lower() in device_name.lower()), None)


def device_peak_tflops(bf16: bool = True) -> float | None:
    return peak_tflops(torch.cuda.get_device_name(), bf16) if torch.cuda.is_available() else None


def peak_memory_gb() -> float:
    """On a GPU the peak allocated since the last reset_peak_memory(); on a CPU the process's peak
    resident size (it cannot be reset)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# Per-rank values whose largest one, and its rank, each log step reports (a rank short of memory, an
# expert-parallel rank holding more, a node whose data loading lags)
RANK_EXTREMES = ("peak_memory_gb", "data_wait_frac")


def rank_extremes(values: dict[str, float], device) -> dict[str, float]:
    """Collective: for each of RANK_EXTREMES in `values`, "<name>_max" over all ranks and
    "<name>_max_rank", the first rank holding it."""
    import torch.distributed as dist

    names = [name for name in RANK_EXTREMES if name in values]
    mine = torch.tensor([values[name] for name in names], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    highest, rank = torch.stack(every).max(dim=0)
    return {**{f"{name}_max": float(v) for name, v in zip(names, highest)},
            **{f"{name}_max_rank": int(r) for name, r in zip(names, rank)}}


class Throughput:
    """Tokens/s and model TFLOP/s per device over the interval since the last call."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, world_size: int, bf16: bool = True):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = device_peak_tflops(bf16)  # MFU against the peak of the run's precision
        self.reset()

    def reset(self) -> None:
        self._t0 = time.perf_counter()
        self._steps = 0
        self._tokens = 0
        self._data_wait_s = 0.0

    def step(self, tokens: int | None = None) -> None:
        """One step of `tokens` (None: tokens_per_step, the config's full-length samples)."""
        self._steps += 1
        self._tokens += self.tokens_per_step if tokens is None else tokens

    def data_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for the next batch."""
        self._data_wait_s += seconds

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (validation, evaluation callbacks, checkpoint saves) counts for no
        interval: the rates describe training steps only."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._t0 += time.perf_counter() - started

    def measure(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tokens_per_s = self._tokens / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        out = {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "step_time_s": elapsed / max(self._steps, 1),
               "data_wait_frac": self._data_wait_s / elapsed}
        if self.peak:
            out["mfu"] = tflops / self.peak
        self.reset()
        return out


STEP_LOGS = ("metrics.jsonl", "losses.jsonl")  # JSON lines with a "step", in RUN_DIR
LOGS_ASIDE = "abandoned_logs"  # RUN_DIR/abandoned_logs/<time>/: records of steps a run trains again


def set_aside_records_after(run_dir: str | Path, step: int) -> int:
    """Move the records of steps after `step` out of the run's step logs into
    RUN_DIR/abandoned_logs/<time>/ (a resume trains those steps again, a rollback another way);
    returns how many moved. Each file is replaced whole (written beside it, then renamed)."""
    run_dir, moved, aside = Path(run_dir), 0, None
    for name in STEP_LOGS:
        path = run_dir / name
        if not path.is_file():
            continue
        keep, drop = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                later = json.loads(line)["step"] > step
            except (ValueError, KeyError, TypeError):  # a line cut by a crash: nothing to keep
                later = True
            (drop if later else keep).append(line)
        if not drop:
            continue
        if aside is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside, n = run_dir / LOGS_ASIDE / stamp, 1
            while aside.exists():  # a second resume within the second
                aside, n = run_dir / LOGS_ASIDE / f"{stamp}-{n}", n + 1
            aside.mkdir(parents=True)
        (aside / name).write_text("".join(drop))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)
        moved += len(drop)
    return moved


class Logger:
    """Rank 0 writes TensorBoard events and a JSON-lines metrics file; other ranks stay quiet.
    A run that starts at `start_step` (a resume, a rollback, or 0 in a used run.dir) hides the
    logged steps after it from TensorBoard (purge_step) and sets their JSON-lines records aside,
    so every step is logged once, by the trajectory the run continues."""

    def __init__(self, run_dir: str | Path, rank: int, start_step: int = 0):
        self.rank = rank
        self.writer = None
        self.metrics_file = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            run_dir = Path(run_dir)
            moved = set_aside_records_after(run_dir, start_step)
            if moved:
                self.print(f"set aside {moved} logged records of steps after {start_step} in {run_dir / LOGS_ASIDE}")
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
            self.metrics_file = open(run_dir / "metrics.jsonl", "a")

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(f"{prefix}{key}", value, step)
        record = {"step": step, "time": time.time(), **{f"{prefix}{k}": v for k, v in values.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def text(self, step: int, values: dict[str, str], prefix: str = "") -> None:
        """Text values (TensorBoard's text tab, as they are: in a code block, not read as Markdown; and
        the JSON-lines record of the step)."""
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_text(f"{prefix}{key}", "```\n" + value.replace("```", "` ` `") + "\n```", step)
        record = {"step": step, "time": time.time(), **{f"{prefix}{k}": v for k, v in values.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def print(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.metrics_file.close()


def count_text(n: float) -> str:
    """12345678 -> '12.3M'."""
    n = float(f"{n:.3g}")  # rounded first: 999,600 is 1M, not 1e+03k
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def progress_line(step: int, total: int, values: dict[str, float], extra: tuple[str, ...] = ()) -> str:
    """`extra`: names of further values to show (the model's own metrics)."""
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}", f"lr {values['lr']:.2e}",
             f"gnorm {values['grad_norm']:.3f}" if "grad_norm" in values else "gnorm n/a",
             f"{values['tokens_per_s']:.0f} tok/s",
             f"{values['tflops_per_device']:.3f} TFLOP/s/dev"]
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    if "data_wait_frac" in values:
        parts.append(f"data {100 * values['data_wait_frac']:.0f}%")
    if "data_wait_frac_max_rank" in values:
        parts[-1] += f" (max {100 * values['data_wait_frac_max']:.0f}% on rank {values['data_wait_frac_max_rank']})"
    if "tokens_seen" in values:
        parts.append(f"seen {count_text(values['tokens_seen'])} tok")
    parts.append(f"mem {values['peak_memory_gb']:.2f} GB")
    if "peak_memory_gb_max_rank" in values:
        parts[-1] += f" (max {values['peak_memory_gb_max']:.2f} GB on rank {values['peak_memory_gb_max_rank']})"
    parts += [f"{name} {values[name]:.4g}" for name in extra]
    return " | ".join(parts)
