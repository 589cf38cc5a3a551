"""One run at a time in a run directory.

The first rank holds an exclusive lock on RUN_DIR/.lock for the run's life, and writes there who
holds it. The kernel releases it when the process ends, however it ends (a crash, a kill, a node
lost), so a requeued job never waits for a stale lock; a second job started into the same
directory (a resubmitted sbatch script, a run started by hand on another node) is refused before
it writes anything, where it would otherwise write over the first one's checkpoints and losses.
A file system that does not lock files (some parallel file systems without their flock option)
leaves this check out.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK = ".lock"
_held: IO | None = None


def owner() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return (f"host {socket.gethostname()}, pid {os.getpid()}" + (f", Slurm job {job}" if job else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}")


def hold(run_dir: Path) -> str | None:
    """Lock `run_dir` for this process (kept until release() or the process ends); why it cannot
    be locked, naming the holder, else None."""
    global _held
    if _held is not None:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "holder unknown"
        lock.close()
        return (f"run.dir={run_dir} is in use by another run ({holder}), which would write over this one's "
                "checkpoints and losses; wait for it to end or stop it, or give this run another run.dir")
    except OSError:  # no locks on this file system
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(owner() + "\n")
    lock.flush()
    _held = lock
    return None


def release() -> None:
    """Give the lock up (a process that runs again, as the tests do; otherwise its end does)."""
    global _held
    if _held is not None:
        _held.close()
        _held = None
