"""Saves by wall-clock time (train.save_interval_minutes), beside those every train.save_interval
steps: a job that can be killed without warning (a preempted node, a crash, a time limit without
Slurm's signal) loses at most that much work, whatever a step costs.

The clock runs from the trainer's start and from each save. Ranks must save at the same step,
so the decision is one all-reduce: a save is due on every rank once it is due on any.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


class SaveTimer:
    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = minutes * 60
        self.clock = clock
        self.last_save = clock()

    def due(self, device="cpu") -> bool:
        """Collective when train.save_interval_minutes is set (every rank calls it at the same step)."""
        if not self.seconds:
            return False
        flag = torch.tensor([float(self.clock() - self.last_save >= self.seconds)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def saved(self) -> None:
        self.last_save = self.clock()
