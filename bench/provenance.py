"""What a benchmark's result file records of the run that wrote it."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def shards_identity(shards: str | Path) -> dict:
    """Which build a benchmark read (losses move with the corpus, its tokenizer and its split): the
    manifest's plan id, tokenizer hash, documents and tokens per split; {"missing": path} without one."""
    manifest = Path(shards) / "manifest.json"
    if not manifest.is_file():
        return {"missing": str(manifest)}
    m = json.loads(manifest.read_text())
    return {"path": str(shards), "plan_id": m.get("plan_id"), "tokenizer_sha256": m.get("tokenizer_sha256"),
            "seq_len": m.get("seq_len"), "documents": m.get("documents"),
            "tokens": {split: info.get("tokens") for split, info in m.get("splits", {}).items()}}


def provenance(module: str, argv: list[str] | None = None, shards: str | Path | None = None) -> dict:
    """Date, torch, machine and the command line (`argv`: the arguments main() was given, default
    this process's); with `shards`, which build of them it read (shards_identity)."""
    import torch

    args = sys.argv[1:] if argv is None else argv
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.machine(),
           "command": " ".join(["python -m", module, *args])}
    if shards is not None:
        out["shards"] = shards_identity(shards)
    return out
