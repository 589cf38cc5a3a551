"""SIGUSR1 (Slurm time limit), SIGTERM (preemption, scancel), SIGINT (Ctrl-C, which launch.local's
agent forwards too), SIGHUP (a closed terminal) and SIGALRM (train.stop_after_minutes) set a flag;
the loops poll it and all ranks agree through an all-reduce, so they stop at the same step boundary,
after a save. SIGQUIT and SIGKILL stop at once.

The handler only records the signal, so a second signal arriving while the checkpoint is being
written changes nothing: the save runs to its end, outside the handler.

The flag is polled after every optimizer step (and every validation batch), not while a rank
waits for data: ranks must leave the loop at the same collective, and a rank that gave up on a
batch would disagree with ranks that already started the step. A data stall therefore delays the
stop by the length of the stall; Slurm's warning time (--signal=...@seconds) has to cover the
longest expected stall plus one step plus one checkpoint save.
"""

from __future__ import annotations

import signal

EXIT_CODE_SAVED_ON_SIGNAL = 85  # exit code of pretrain.train after it saved and stopped on a signal

_received: list[int] = []
_tracker_started: list[bool] = []  # by install(), with the stop signals ignored


def _handler(signum, frame) -> None:  # noqa: ARG001
    # Only record: saving happens at the next step boundary, outside the handler.
    _received.append(signum)


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def install(signals=STOP_SIGNALS) -> None:
    """Record these signals from now on. The entry points call it first of all, before importing
    torch (seconds): a signal during those imports is then kept for the first step boundary
    instead of killing the process by its default action. Multiprocessing's resource tracker
    (started here, for the shared memory the loaders use) ignores them, as it ignores SIGINT and
    SIGTERM itself: a signal sent to every process of a Slurm step would kill it otherwise, and the
    tracker started in its place reports the others' shared memory as unknown."""
    from multiprocessing import resource_tracker

    if not _tracker_started:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)  # ignored signals stay ignored in the tracker it starts
        resource_tracker.ensure_running()
        _tracker_started.append(True)
    for sig in signals:
        signal.signal(sig, _handler)


def stop_after(seconds: float) -> None:
    """SIGALRM after `seconds` (train.stop_after_minutes), recorded as the stop signals are: the run
    saves and stops at the step boundary after it, as on a time-limit signal the scheduler never
    sent. Forked processes (data workers) do not inherit the timer."""
    signal.signal(signal.SIGALRM, _handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def any_rank_received(device="cpu") -> int:
    """Collective: on every rank, the number of the first signal received by any rank (the highest
    number when ranks got different ones), 0 while none arrived. Use it as a truth value."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(_received[0]) if _received else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
