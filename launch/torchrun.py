"""torchrun (python -m torch.distributed.run, same arguments) whose agent acts on the first signal only.

    python -m launch.torchrun --nnodes=2 --nproc-per-node=8 ... -m pretrain.train --config cfg.yaml

On a handled signal the torchrun agent forwards it to the workers and waits up to
--shutdown-timeout for them to save and exit. A second signal during that wait makes the stock
agent raise again and exit at once, abandoning the workers mid-save. On Slurm that happens
whenever one stop reaches the agent twice: a preemption or `scancel --signal` signals every process
of the step, srun forwards what it receives, and the batch script forwards what it traps. Here the
agent ignores signals after the first; the workers still get the first one (and any signal Slurm
sends them directly), and the shutdown timeout still bounds the wait.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.run import main as _torchrun_main

_first: list[int] = []
_stock_handler = getattr(_mp_api, "_terminate_process_handler", None)


def _first_signal_only(signum, frame) -> None:
    if _first:
        return  # already shutting the workers down; keep waiting for them
    _first.append(signum)
    _stock_handler(signum, frame)  # raises SignalException: the agent starts its shutdown


if _stock_handler is not None:  # torch registers the module attribute when the workers start
    _mp_api._terminate_process_handler = _first_signal_only


if __name__ == "__main__":
    try:
        sys.exit(_torchrun_main())
    except _mp_api.SignalException as stop:  # the workers had the signal and --shutdown-timeout to save
        print(f"torchrun agent: stopped on signal {stop.sigval.name} after the workers' shutdown", file=sys.stderr)
        sys.exit(128 + int(stop.sigval))
