"""`torch.profiler` traces of chosen training steps, for finding where a step's time goes.

    python -m pretrain.train --config C profile.start_step=20 profile.steps=3 profile.ranks=0,8

traces steps 20-22 (step 19 warms the profiler up) on ranks 0 and 8 and writes, per rank, into
RUN_DIR/profile/:
  rank<R>_steps<A>-<B>.json.gz   Chrome trace; open it in https://ui.perfetto.dev
  rank<R>_steps<A>-<B>.txt       the top operators by self time (CUDA time on GPUs)
With profile.memory=true the trace also records allocations (memory timeline in Perfetto).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from pretrain.config import parse_ranks
from pretrain.trainer import Callback

TOP_OPERATORS = 40


def time_metric() -> str:
    """Where a step's time goes: GPU kernel time on GPUs, CPU time otherwise."""
    return "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"


def operator_table(prof: profile, rows: int = TOP_OPERATORS) -> str:
    return prof.key_averages().table(sort_by=time_metric(), row_limit=rows) + "\n"


def top_operators(prof: profile, rows: int = 10) -> list[dict]:
    """The operators with the most self time: name, milliseconds, share of all self time, calls. On
    GPUs an operator's self time is that of the kernels it launched; the kernels' own rows are left
    out so that nothing is counted twice."""
    metric = time_metric()
    ops = [op for op in prof.key_averages()
           if op.device_type == DeviceType.CPU and not op.key.startswith("ProfilerStep")]
    total = sum(getattr(op, metric) for op in ops) or 1
    ops.sort(key=lambda op: getattr(op, metric), reverse=True)
    return [{"op": op.key, "ms": getattr(op, metric) / 1e3, "share": getattr(op, metric) / total, "calls": op.count}
            for op in ops[:rows]]


class ProfilerCallback(Callback):
    """Profiles train steps [start_step, start_step + steps) on the chosen ranks, after one warm-up
    step when this process runs the step before the window. A resumed run that starts inside the
    window profiles what is left of it; a run that stops inside it writes what it recorded. Steps
    are marked ProfilerStep#<train step> in the trace."""

    def __init__(self, run_dir: str | Path, start_step: int, steps: int, ranks: str = "0", memory: bool = False):
        self.out_dir = Path(run_dir) / "profile"
        self.end = start_step + steps  # first step after the window
        self.start_step, self.memory = start_step, memory
        self.ranks = parse_ranks(ranks)
        self.profiler: profile | None = None
        self.first = self.warmup = 0  # first profiled step, and the warm-up step before it (0: none)
        self.prepared = self.tracing = False
        self.step_range: record_function | None = None

    def on_train_begin(self, trainer, step: int) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if (self.ranks is not None and self.rank not in self.ranks) or step + 1 >= self.end:
            return
        self.first = max(self.start_step, step + 1)
        self.warmup = self.first - 1 if self.first - 1 > step else 0
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=self.activities, record_shapes=True, profile_memory=self.memory)

    def on_step_begin(self, trainer, step: int) -> None:
        if self.profiler is None:
            return
        if step in (self.warmup, self.first) and not self.prepared:
            self.profiler.prepare_trace()  # from the warm-up step on: set up, nothing recorded yet
            self.prepared = True
        if step == self.first:
            self.profiler.start_trace()
            self.tracing = True
        elif self.tracing:
            self.profiler.toggle_collection_dynamic(True, self.activities)
        if self.tracing:
            self.step_range = record_function(f"ProfilerStep#{step}")
            self.step_range.__enter__()

    def on_optimizer_step(self, trainer, step: int) -> None:
        """The step ends with its update: validation, saves and callbacks after it are not recorded
        (the trace and the operator table hold the profiled steps only)."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels are recorded before collection pauses
            self.profiler.toggle_collection_dynamic(False, self.activities)

    def on_step_end(self, trainer, result) -> None:
        if self.profiler is None:
            return
        if result.step == self.end - 1:
            self._finish(result.step)

    def on_train_end(self, trainer, step: int) -> None:
        if self.profiler is not None:  # the run stopped inside the window or before it
            self._finish(step)

    def _finish(self, last_step: int) -> None:
        profiler, self.profiler = self.profiler, None
        if not self.tracing:  # stopped before the window: close what the warm-up opened
            if self.prepared:
                profiler.start_trace()
                profiler.stop_trace()
            return
        profiler.stop_trace()
        self.tracing = False
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self.first}-{last_step}"
        trace = self.out_dir / f"{name}.json.gz"
        profiler.export_chrome_trace(str(trace))
        table = self.out_dir / f"{name}.txt"
        table.write_text(operator_table(profiler))
        print(f"rank {self.rank}: profile of steps {self.first}-{last_step} written to {trace} and {table.name}",
              flush=True)
