"""One run at a time in a run directory.

The first rank holds an exclusive lock on RUN_DIR/.lock for the run's life, and writes there who
holds it. The kernel releases it when the process ends, however it ends (a crash, a kill, a node
lost), so a requeued job never waits for a stale lock; a second job started into the same
directory (a resubmitted sbatch script, a run started by hand on another node) is refused before
it writes its config, checkpoints or losses, which would replace the first one's. A lock that a
lost node's file-system client still holds (NFSv3 keeps such locks until the node comes back) is
passed over where its holder is an earlier run of this Slurm job, or a job Slurm no longer runs.
A file system that does not lock files (some parallel file systems without their flock option)
leaves this check out.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
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
    taken = _take(lock)
    if taken is None:  # no locks on this file system
        lock.close()
        return None
    if not taken:
        lock.seek(0)
        holder = lock.read().strip() or "holder unknown"
        lock.close()
        job = slurm_job_of(holder)
        if job and (job == os.environ.get("SLURM_JOB_ID") or slurm_job_ended(job)):
            return None  # a lost node's stale lock: that job runs no more
        return (f"run.dir={run_dir} is in use by another run ({holder}), which would write over this one's "
                "checkpoints and losses; wait for it to end or stop it, or give this run another run.dir")
    lock.seek(0)
    lock.truncate()
    lock.write(owner() + "\n")
    lock.flush()
    _held = lock
    return None


def _take(lock: IO, attempts: int = 5) -> bool | None:
    """Whether the exclusive lock was taken (None: the file system has no locks). A second or so of
    tries: holder() takes the lock for an instant to look."""
    for attempt in range(attempts):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.2 if attempt < attempts - 1 else 0)
        except OSError:
            return None
    return False


def slurm_job_of(holder: str | None) -> str | None:
    """The Slurm job id a lock's holder line names (owner()), if any."""
    found = re.search(r"Slurm job (\S+?),", holder or "")
    return found[1] if found else None


def slurm_job_ended(job: str) -> bool:
    """Whether Slurm no longer runs `job` (squeue lists it not, or no more); False where squeue
    cannot tell."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode != 0:
        return "Invalid job id" in out.stderr
    return out.stdout.strip() in ("", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                  "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def holder(run_dir: Path) -> str | None:
    """Who runs in `run_dir` now (host, pid, Slurm job), as its lock names them; None when no
    process holds the lock (or the file system has none)."""
    try:
        lock = open(Path(run_dir) / LOCK)
    except OSError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock.read().strip() or "holder unknown"
        except OSError:
            return None
        fcntl.flock(lock, fcntl.LOCK_UN)
    return None


def release() -> None:
    """Give the lock up (a process that runs again, as the tests do; otherwise its end does)."""
    global _held
    if _held is not None:
        _held.close()
        _held = None
