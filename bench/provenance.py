"""What a benchmark's result file records of the run that wrote it."""

from __future__ import annotations

import platform
import sys
import time


def provenance(module: str, argv: list[str] | None = None) -> dict:
    """Date, torch, machine and the command line (`argv`: the arguments main() was given, default
    this process's)."""
    import torch

    args = sys.argv[1:] if argv is None else argv
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.machine(),
            "command": " ".join(["python -m", module, *args])}
