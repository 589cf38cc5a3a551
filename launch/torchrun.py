"""torchrun (python -m torch.distributed.run, same arguments) whose agent acts on the first signal only.

    python -m launch.torchrun --nnodes=2 --nproc-per-node=8 ... -m pretrain.train --config cfg.yaml

On a handled signal the torchrun agent forwards it to the workers and waits up to
--shutdown-timeout for them to save and exit. A second signal during that wait makes the stock
agent raise again and exit at once, abandoning the workers mid-save. On Slurm that happens
whenever one stop reaches the agent twice: a preemption or `scancel --signal` signals every process
of the step, srun forwards what it receives, and the batch script forwards what it traps. Here the
agent ignores signals after the first; the workers still get the first one (and any signal Slurm
sends them directly), and the shutdown timeout still bounds the wait.

Before its workers start (importing torch, a multi-node rendezvous of minutes while slow nodes
start) a handled signal stops the agent with exit code NOT_STARTED instead of killing it: nothing
was trained, which the batch script tells apart from a failed step. So does a file named by
PRETRAIN_SIGNAL_FILE, found when the agent starts: the batch script writes the signal's name there
before forwarding it, since a signal forwarded while srun is still registering the step reaches
no process of it.

Workers that all exit with pretrain.signals.EXIT_CODE_SAVED_ON_SIGNAL (85: they saved and stopped on
a signal sent to them, or on train.stop_after_minutes) make the agent exit 85 too, not torchrun's 1
for a failed worker: launch.local then says "saved, run again" by its exit code, as one process does.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from launch.sbatch import NOT_STARTED, SIGNAL_FILE_ENV  # noqa: F401 - NOT_STARTED: for importers too
from pretrain.signals import EXIT_CODE_SAVED_ON_SIGNAL

_before_workers: list[int] = []


def agent_options(argv: list[str]) -> int:
    """How many leading arguments are the agent's: those before the training module or script."""
    return next((i for i, arg in enumerate(argv) if arg in ("-m", "--module") or arg.endswith(".py")), len(argv))


def handled_signals(argv: list[str]) -> list[signal.Signals]:
    """The signals of --signals-to-handle (or PET_SIGNALS_TO_HANDLE, as torchrun reads it; torchrun's
    default where neither is given)."""
    names = os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for i, arg in enumerate(argv[:agent_options(argv)]):
        if arg.startswith(("--signals-to-handle=", "--signals_to_handle=")):
            names = arg.split("=", 1)[1]
        elif arg in ("--signals-to-handle", "--signals_to_handle") and i + 1 < len(argv):
            names = argv[i + 1]
    return [getattr(signal, name.strip()) for name in names.split(",") if hasattr(signal, name.strip())]


def forwarded_signal(path: str | None) -> str | None:
    """The signal the batch script forwarded to this step before the agent could receive it, if any."""
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or "a signal"
    except FileNotFoundError:
        return None


def _stop_before_workers(signum, frame) -> None:
    """The agent's handler until torch registers its own as the workers start: records the signal
    and, once the agent runs, raises torch's SignalException there (it then shuts down cleanly)."""
    _before_workers.append(signum)
    agent_api = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    if _started_agent and agent_api is not None:
        raise agent_api.SignalException(f"Process {os.getpid()} got signal {signum} before its workers started",
                                        sigval=signal.Signals(signum))


_started_agent = False
if __name__ == "__main__":  # first of all, before the imports of torch (seconds)
    for _handled in handled_signals(sys.argv[1:]):
        signal.signal(_handled, _stop_before_workers)
    # Read after the handlers are in place: a signal forwarded later reaches this process.
    if (_forwarded := forwarded_signal(os.environ.get(SIGNAL_FILE_ENV))) is not None:
        print(f"torchrun agent: {_forwarded} was forwarded to this step before it started; not starting",
              file=sys.stderr)
        sys.exit(NOT_STARTED)

from torch.distributed.elastic.multiprocessing import api as _mp_api  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main as _torchrun_main  # noqa: E402

_first: list[int] = []
_stock_handler = getattr(_mp_api, "_terminate_process_handler", None)


def _first_signal_only(signum, frame) -> None:
    if _first:
        return  # already shutting the workers down; keep waiting for them
    _first.append(signum)
    _stock_handler(signum, frame)  # raises SignalException: the agent starts its shutdown


if _stock_handler is not None:  # torch registers the module attribute when the workers start
    _mp_api._terminate_process_handler = _first_signal_only


def with_store_host(argv: list[str], node_id: str | None) -> list[str]:
    """The agent's arguments with the c10d store's host said outright under Slurm: the first node
    (SLURM_NODEID 0, the node the batch script takes the rendezvous address from) hosts it. torch
    otherwise guesses by whether the endpoint is one of this machine's addresses, which fails for
    the address of a second interface (no node hosts: every agent times out) and for a loopback
    one (every node hosts its own store and waits alone)."""
    if node_id is None:
        return argv
    is_host = f"is_host={int(node_id == '0')}"
    out, i, end = list(argv), 0, agent_options(argv)
    while i < end:
        option, equals, value = out[i].partition("=")
        if option in ("--rdzv-conf", "--rdzv_conf"):
            if not equals and i + 1 < end:  # the value as the next argument
                i += 1
                option, value = "", out[i]
            if "is_host=" in value:
                return argv  # given: left as it is
            joined = f"{value},{is_host}" if value else is_host
            out[i] = f"{option}={joined}" if option else joined
            return out
        i += 1
    return [f"--rdzv-conf={is_host}", *out]


if __name__ == "__main__":
    sys.argv[1:] = with_store_host(sys.argv[1:], os.environ.get("SLURM_NODEID"))
    _started_agent = True  # first: a signal from here on raises in the agent
    if _before_workers:  # while torch was imported
        print(f"torchrun agent: stopped on signal {signal.Signals(_before_workers[0]).name} before its workers "
              "started", file=sys.stderr)
        sys.exit(NOT_STARTED)
    try:
        sys.exit(_torchrun_main())
    except _mp_api.SignalException as stop:
        if _before_workers:
            print(f"torchrun agent: stopped on signal {stop.sigval.name} before its workers started",
                  file=sys.stderr)
            sys.exit(NOT_STARTED)
        # The agent cannot tell whether they saved: rank 0's log and RUN_DIR/STOPPED_ON_SIGNAL say.
        print(f"torchrun agent: stopped on signal {stop.sigval.name}; the workers had it and up to "
              "--shutdown-timeout to save", file=sys.stderr)
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        # Workers that saved and stopped (a signal sent to them, train.stop_after_minutes) are not a
        # failure: the agent exits with their code, as a single process would, not with 1.
        if not all(f.exitcode == EXIT_CODE_SAVED_ON_SIGNAL for f in failed.failures.values()):
            raise
        print(f"torchrun agent: the workers saved a checkpoint and stopped (exit code {EXIT_CODE_SAVED_ON_SIGNAL}); "
              "the same command resumes", file=sys.stderr)
        sys.exit(EXIT_CODE_SAVED_ON_SIGNAL)
