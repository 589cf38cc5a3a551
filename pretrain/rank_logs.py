"""A quiet console: only global rank 0 writes to the terminal; every other rank writes its stdout and
stderr (library warnings, start-up chatter, everything) to RUN_DIR/logs/rank{R}.log.

Set up before the heavy imports, which print their warnings at import time: until the run
directory is known the other ranks write to a temporary file, which :func:`settle` moves into the
run directory. A traceback of an uncaught error also goes to the terminal, so a rank that crashes
alone is still seen there. PRETRAIN_RANK_LOGS=0 keeps every rank on the terminal. Torch-free.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

_state: dict = {}


def _rank() -> int:
    # RANK under torchrun; SLURM_PROCID under a plain srun launch (pretrain.distributed maps it later).
    try:
        return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    except ValueError:
        return 0


def _point_at(path: Path) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def quiet_other_ranks() -> None:
    """On ranks other than 0: send fds 1 and 2 to a temporary file (see settle)."""
    if _rank() == 0 or os.environ.get("PRETRAIN_RANK_LOGS", "1") == "0" or _state:
        return
    fd, name = tempfile.mkstemp(prefix=f"pretrain-rank{_rank()}-", suffix=".log")
    os.close(fd)
    _state.update(console=os.dup(2), path=Path(name))
    _point_at(_state["path"])
    sys.excepthook = _report_to_console_too


def settle(run_dir: str | os.PathLike) -> Path | None:
    """Move this rank's log into RUN_DIR/logs/rank{R}.log (appending) and keep writing there."""
    if not _state or "final" in _state:
        return _state.get("final")
    final = Path(run_dir) / "logs" / f"rank{_rank()}.log"
    final.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(final, "ab") as out:
        out.write(_state["path"].read_bytes())
    _point_at(final)
    _state["path"].unlink(missing_ok=True)
    _state["final"] = final
    return final


def discard_unsettled() -> None:
    """Drop the temporary log of a run that ended before its run directory was known (a config
    error, which rank 0 reports for every rank)."""
    if "final" not in _state and "path" in _state:
        _state["path"].unlink(missing_ok=True)


def to_console(text: str) -> None:
    """Write to the terminal whatever rank this is (its log gets the text too)."""
    print(text, file=sys.stderr, flush=True)
    if "console" in _state:
        os.write(_state["console"], (text.rstrip("\n") + "\n").encode())


def _report_to_console_too(kind, value, tb) -> None:
    text = "".join(traceback.format_exception(kind, value, tb))
    where = _state.get("final", _state.get("path"))
    to_console(f"[rank {_rank()}] {text.rstrip()}\n[rank {_rank()}] (its whole output: {where})")
