"""Streaming's shared memory on a node: which blocks a start may release.

Each StreamingDataset keeps its state in blocks named `NNNNNN_<name>` under /dev/shm (NNNNNN its
prefix), its resume offset among them, read again at every checkpoint. A killed process leaves its
blocks behind, and a run whose cache folder they name cannot start. streaming's own cleaner clears
every block from prefix 0 up to the first free one: a live run's too, whose next checkpoint then
records its position as counted from its resume. Here each process registers the prefixes it uses,
and a start releases only the blocks no live process uses."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")


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


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


def register(prefix: int) -> None:
    """Record that this process uses the blocks of `prefix` (called after each dataset is built)."""
    if not SHM_DIR.is_dir():
        return
    owners = _owners_dir()
    owners.mkdir(exist_ok=True)
    (owners / f"{prefix:06}.{os.getpid()}").write_text(_start_time(os.getpid()) or "")


def _blocks() -> dict[int, list[Path]]:
    """This user's streaming blocks by prefix."""
    from streaming.base.constant import SHM_TO_CLEAN

    pattern = re.compile(rf"(\d{{6}})_({'|'.join(SHM_TO_CLEAN)})")
    blocks: dict[int, list[Path]] = {}
    for path in SHM_DIR.iterdir():
        match = pattern.fullmatch(path.name)
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


def release_stale(cache: Path) -> list[int]:
    """Unlink the blocks (and filelocks) of every prefix no live process uses: those registered by
    processes that have exited, and unregistered ones that read under `cache` (this run's cache
    folder: left by a killed start of this run, or by a version that did not register). Other
    unregistered blocks may be another program's and are left alone. Returns the released prefixes.
    Raises when another live process reads under `cache`: the same run started twice on one node."""
    if not SHM_DIR.is_dir():
        return []
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

    owners: dict[int, list[tuple[Path, int, str]]] = {}
    if _owners_dir().is_dir():
        for entry in _owners_dir().iterdir():
            prefix, _, pid = entry.name.partition(".")
            if prefix.isdigit() and pid.isdigit():
                owners.setdefault(int(prefix), []).append((entry, int(pid), entry.read_text()))
    cache = os.path.abspath(cache)
    released = []
    for prefix, paths in sorted(_blocks().items()):
        entries = owners.get(prefix, [])
        live = [pid for _, pid, start in entries if _alive(pid, start)]
        ours = any(os.path.commonpath([cache, os.path.abspath(local)]) == cache for local in _locals(prefix))
        if live:
            others = sorted(set(live) - {os.getpid()})
            if ours and others:
                raise RuntimeError(
                    f"process {others[0]} on this node reads this run's data cache {cache}: is the run "
                    f"already running here? Stop it first, or give this run another run.dir or data.cache")
            continue
        if not entries and not ours:
            continue
        for path in paths:
            path.unlink(missing_ok=True)
        for lock in (BARRIER_FILELOCK, CACHE_FILELOCK):
            Path(tempfile.gettempdir(), f"{prefix:06}_{lock}").unlink(missing_ok=True)
        released.append(prefix)
    for entries in owners.values():  # registrations of processes that have exited
        for entry, pid, start in entries:
            if not _alive(pid, start):
                entry.unlink(missing_ok=True)
    return released
