"""Resume at another data- or tensor-parallel size through DeepSpeed's universal checkpoints.

A checkpoint holds ZeRO optimizer shards per data-parallel rank and weight slices per tensor-parallel
rank. To continue it on another layout, DeepSpeed's ``ds_to_universal`` rewrites it into one file per
parameter (weights, Adam moments), which any layout loads with ``checkpoint.load_universal``. The
conversion runs once, on rank 0 before any process group exists (the other ranks wait for its
marker), into ``checkpoints/universal/<tag>`` (marked complete last, so an interrupted conversion is
redone); the original checkpoint is never changed. Every save records
which parameters tensor parallelism splits along dim 1 (row-parallel) and which it replicates, the
metadata the converter needs to merge the slices (the rest are split along dim 0). (The converter
fails on None tensors; models.gpt leaves megatron-core's empty extra state out of state dicts.)
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torch import nn

from pretrain.checkpoint_format import checkpoint_dir, own_tag

UNIVERSAL_DIR = "universal"
DONE = "CONVERTED"
FOREIGN = "@"  # in the name of a conversion of another run's checkpoint


def checkpoint_info(model: nn.Module) -> dict:
    """client_state[UNIVERSAL_CHECKPOINT_INFO] for a save of ``model``."""
    from deepspeed.checkpoint.constants import (
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        TP_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
    )

    row, replicated = [], []
    for name, param in model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False):
            replicated.append(rf"^{re.escape(name)}$")
        elif getattr(param, "partition_dim", 0) == 1:
            row.append(rf"^{re.escape(name)}$")
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.2, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row,
            TP_REPLICATED_PARAMETER_PATTERNS: replicated}


def universal_path(tag_dir: Path, run_dir: str | Path) -> Path:
    """Where the run in `run_dir` keeps the universal form of `tag_dir`: beside its own checkpoints
    as checkpoints/universal/<tag>; another run's checkpoint's (which may be read-only, or another
    user's) in this run's checkpoints/universal/<tag>@<hash of its path>, removed once this run has a
    checkpoint of its own (pretrain.checkpoint)."""
    tag_dir = Path(tag_dir)
    if own_tag(run_dir, tag_dir):
        return tag_dir.parent / UNIVERSAL_DIR / tag_dir.name
    where = hashlib.sha256(str(tag_dir.resolve()).encode()).hexdigest()[:8]
    return checkpoint_dir(run_dir) / UNIVERSAL_DIR / f"{tag_dir.name}{FOREIGN}{where}"


def convert(tag_dir: Path, run_dir: str | Path, log=print) -> Path:
    """The universal form of ``tag_dir`` (converted now unless already cached); call on one rank."""
    out = universal_path(tag_dir, run_dir)
    if (out / DONE).is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {tag_dir} to a universal checkpoint in {out} (once: later resumes reuse it)")
    res = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(tag_dir), "--output_folder", str(out), "--num_extract_workers", "1",
                          "--num_merge_workers", "1"], capture_output=True, text=True)
    if res.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        tail = "\n".join(res.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"ds_to_universal failed on {tag_dir} (exit {res.returncode}):\n{tail}")
    (out / DONE).write_text("ok\n")
    return out


def wait_converted(tag_dir: Path, run_dir: str | Path, poll_s: float = 2.0) -> Path:
    """On the other ranks: wait for rank 0's conversion (no collective, whose timeout a large model's
    conversion could exceed; if rank 0 fails, the launcher stops this rank)."""
    out = universal_path(tag_dir, run_dir)
    while not (out / DONE).is_file():
        time.sleep(poll_s)
    return out
