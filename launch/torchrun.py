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

import os
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


def with_store_host(argv: list[str], node_id: str | None) -> list[str]:
    """The agent's arguments with the c10d store's host said outright under Slurm: the first node
    (SLURM_NODEID 0, the node the batch script takes the rendezvous address from) hosts it. torch
    otherwise guesses by whether the endpoint is one of this machine's addresses, which fails for
    the address of a second interface (no node hosts: every agent times out) and for a loopback
    one (every node hosts its own store and waits alone)."""
    if node_id is None:
        return argv
    is_host = f"is_host={int(node_id == '0')}"
    out, i = list(argv), 0
    while i < len(out) and out[i] not in ("-m", "--module") and not out[i].endswith(".py"):  # its options
        option, _, value = out[i].partition("=")
        if option in ("--rdzv-conf", "--rdzv_conf"):
            if not value and i + 1 < len(out):
                i += 1
                option, value = "", out[i]
            if "is_host=" in value:
                return argv  # given: left as it is
            out[i] = f"{option}={value},{is_host}" if option else f"{value},{is_host}"
            return out
        i += 1
    return [f"--rdzv-conf={is_host}", *out]


if __name__ == "__main__":
    sys.argv[1:] = with_store_host(sys.argv[1:], os.environ.get("SLURM_NODEID"))
    try:
        sys.exit(_torchrun_main())
    except _mp_api.SignalException as stop:  # the workers had the signal and --shutdown-timeout to save
        print(f"torchrun agent: stopped on signal {stop.sigval.name} after the workers' shutdown", file=sys.stderr)
        sys.exit(128 + int(stop.sigval))
