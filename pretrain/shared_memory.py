"""Streaming's shared memory on a node: which blocks a start may release.

Each StreamingDataset keeps its state in blocks named `NNNNNN_<name>` under /dev/shm (NNNNNN its
prefix), its resume offset among them, read again at every checkpoint. A killed process leaves its
blocks behind, and a run whose cache folder they name cannot start. streaming's own cleaner clears
every block from prefix 0 up to the first free one: a live run's too, whose next checkpoint then
records its position as counted from its resume. Here each process registers the prefixes it uses,
and a start releases only the blocks no live process uses. A registration is held open under a shared
lock while its process lives: the kernel drops the lock when the process dies, in any pid namespace
(containers sharing /dev/shm), where a pid cannot be looked up."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_registered: list[Path] = []  # this process's registrations, removed at exit
_held: list = []  # their open files, each under a shared lock while this process lives


def _owners_dir() -> Path:
    return SHM_DIR / f"pretrain-streaming-owners-{os.getuid()}"  # one per user: /dev/shm is shared


def _start_time(pid: int) -> str | None:
    """A process's start time (/proc/PID/stat field 22), which tells a reused pid apart; None when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_namespace() -> str:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def _alive(entry: Path, record: dict, pid: int) -> bool:
    """Whether a registration's process still runs: whether its entry is still locked (an entry
    removed meanwhile was unregistered). Registrations without the lock (older versions) by the pid;
    one of those in another pid namespace cannot be looked up from here: it counts as alive."""
    if record.get("locked"):
        try:
            with open(entry) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False
    if record.get("pid_namespace") != _pid_namespace():
        return True
    started = _start_time(pid)
    return started is not None and started == record.get("start")


CREATE_LOCK = SHM_DIR / "pretrain-streaming-create.lock"  # one per node, for every user's jobs
LOCK_ATTEMPTS = 1000  # with the pauses between them, some minutes


def _open_create_lock():
    """The node's dataset-creation lock file, readable and writable by every user (streaming's
    blocks are visible to all of them); this user's own where another user's cannot be opened."""
    old = os.umask(0)
    try:
        return os.fdopen(os.open(CREATE_LOCK, os.O_RDWR | os.O_CREAT, 0o666), "r+")
    except OSError:
        _owners_dir().mkdir(exist_ok=True)
        return open(_owners_dir() / ".create-lock", "a+")
    finally:
        os.umask(old)


@contextlib.contextmanager
def creating_datasets():
    """Around the building of streaming datasets, on every rank of a job: one job on a node at a
    time. Each rank picks the dataset's shared-memory prefix by scanning /dev/shm, and the node's
    first rank then registers it; a dataset another job on the node creates in between makes the
    scans differ ("shared memory registered does not match local leader"). So the first rank of
    each of the job's nodes holds that node's lock while all ranks build. A job takes its nodes'
    locks all at once or none: each first rank tries its lock without waiting, and unless every one
    got it they all let go and try again after a random pause. Waiting for one lock while holding
    another would deadlock two multi-node jobs that share nodes."""
    import itertools
    import random
    import time

    import torch
    import torch.distributed as dist

    lock = _open_create_lock() if _node_leader() else None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one process: nothing else held meanwhile
            yield
            return
        from pretrain.distributed import device

        backoff = random.Random(f"{os.getpid()}-{time.time_ns()}")
        for attempt in itertools.count():
            if attempt == LOCK_ATTEMPTS:
                raise RuntimeError(f"could not take the streaming dataset lock {CREATE_LOCK} on all of this job's "
                                   f"nodes in {LOCK_ATTEMPTS} tries: another job builds its datasets without end, or "
                                   "two nodes of this job share one /dev/shm (give each node its own)")
            got = True
            if lock is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    got = False
            every = torch.tensor([float(got)], device=device())
            dist.all_reduce(every, op=dist.ReduceOp.MIN)  # also the barrier before the ranks scan
            if every.item():
                break
            if got and lock is not None:  # (ranks other than a node's leader hold no lock)
                fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(backoff.uniform(0.05, 0.2) * min(attempt + 1, 20))
        yield
        dist.barrier()  # every rank has found its prefix
    finally:
        if lock is not None:
            lock.close()  # closing releases the lock


def _node_leader() -> bool:
    """Whether this process takes its node's lock: its first rank (where /dev/shm is)."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and SHM_DIR.is_dir()


def register(prefix: int) -> None:
    """Record that this process uses the blocks of `prefix` and which folders they read (called after
    each dataset is built); removed when the process exits."""
    if not SHM_DIR.is_dir():
        return
    owners = _owners_dir()
    owners.mkdir(exist_ok=True)
    entry = owners / f"{prefix:06}.{os.getpid()}"
    record = {"start": _start_time(os.getpid()), "pid_namespace": _pid_namespace(), "locals": _locals(prefix),
              "locked": True}
    held = open(entry, "w")
    fcntl.flock(held, fcntl.LOCK_SH)  # before the record is readable: never seen unlocked while alive
    held.write(json.dumps(record))
    held.flush()
    if not _registered:
        atexit.register(_unregister)
    _registered.append(entry)
    _held.append(held)


def _unregister() -> None:
    for entry in _registered:
        entry.unlink(missing_ok=True)
    for held in _held:
        held.close()


def _blocks() -> dict[int, list[Path]]:
    """This user's streaming blocks by prefix."""
    from streaming.base.constant import SHM_TO_CLEAN

    pattern = re.compile(rf"(\d{{6}})_({'|'.join(SHM_TO_CLEAN)})")
    blocks: dict[int, list[Path]] = {}
    for path in SHM_DIR.iterdir():
        match = pattern.fullmatch(path.name)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile by its owner
            if match and path.stat().st_uid == os.getuid():
                blocks.setdefault(int(match[1]), []).append(path)
    return blocks


def _locals(prefix: int) -> list[str]:
    """The local folders a prefix's datasets read (its `locals` block), [] when unreadable."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _unpack_locals

    try:
        return _unpack_locals((SHM_DIR / f"{prefix:06}_{LOCALS}").read_bytes())[0]
    except (OSError, ValueError, IndexError):
        return []


def _registrations() -> dict[int, list[tuple[Path, int, dict]]]:
    """{prefix: [(entry, pid, record)]}; unreadable entries are left out."""
    owners: dict[int, list[tuple[Path, int, dict]]] = {}
    for entry in _owners_dir().iterdir():
        prefix, _, pid = entry.name.partition(".")
        if not (prefix.isdigit() and pid.isdigit()):
            continue
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):  # removed meanwhile, or half written
            continue
        if isinstance(record, dict):
            owners.setdefault(int(prefix), []).append((entry, int(pid), record))
    return owners


def release_stale(cache: Path) -> list[int]:
    """Unlink the blocks (and filelocks) of every prefix no live process uses: those registered by
    processes that have exited (while the blocks still read what they recorded: a prefix is reused
    once freed), and unregistered ones that read under `cache` (this run's cache folder: left by a
    killed start of this run, or by a version that did not register). Other unregistered blocks may
    be another program's and are left alone. Returns the released prefixes. Raises RuntimeError
    when another live process reads under `cache`: the same run started twice on one node."""
    if not SHM_DIR.is_dir():
        return []
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

    _owners_dir().mkdir(exist_ok=True)
    with open(_owners_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # starts on one node release one at a time
        owners = _registrations()
        cache = os.path.abspath(cache)
        released = []
        for prefix, paths in sorted(_blocks().items()):
            local = _locals(prefix)
            claims = [(entry, pid, record) for entry, pid, record in owners.get(prefix, [])
                      if record.get("locals") == local]  # else the prefix is another dataset's now
            live = [pid for entry, pid, record in claims if _alive(entry, record, pid)]
            ours = any(os.path.commonpath([cache, os.path.abspath(folder)]) == cache for folder in local)
            if live:
                others = sorted(set(live) - {os.getpid()})
                if ours and others:
                    raise RuntimeError(
                        f"process {others[0]} on this node reads this run's data cache {cache}: is the "
                        f"run already running here? Stop it first, or give this run another run.dir or "
                        f"data.cache")
                continue
            if not claims and not ours:
                continue
            for path in paths:
                path.unlink(missing_ok=True)
            for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
                Path(tempfile.gettempdir(), f"{prefix:06}_{name}").unlink(missing_ok=True)
            released.append(prefix)
        for entries in owners.values():  # registrations of processes that have exited
            for entry, pid, record in entries:
                if not _alive(entry, record, pid):
                    entry.unlink(missing_ok=True)
    return released
