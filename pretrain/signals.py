"""SIGUSR1 (Slurm time limit) and SIGTERM (preemption, scancel) set a flag; the loops poll it
and all ranks agree through an all-reduce, so they stop at the same step boundary."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_CODE_SAVED_ON_SIGNAL = 85  # the batch script requeues the job on this code

_received: list[int] = []


def _handler(signum, frame) -> None:  # noqa: ARG001
    # Only record: saving happens at the next step boundary, outside the handler.
    _received.append(signum)


def install(signals=(signal.SIGUSR1, signal.SIGTERM)) -> None:
    for sig in signals:
        signal.signal(sig, _handler)


def received_locally() -> bool:
    return bool(_received)


def any_rank_received(device: torch.device | str = "cpu") -> bool:
    """Collective: True on every rank as soon as one rank got a signal."""
    flag = torch.tensor([1.0 if _received else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def reset() -> None:
    _received.clear()
