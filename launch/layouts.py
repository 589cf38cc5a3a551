"""The layouts a size config recommends in its header comment, as dotted overrides.

    # 8x80GB nodes: 1 parallel.tensor=1 parallel.expert=8 ... train.micro_batch=8 ...
    # single-gpu (80-141 GB): parallel.tensor=1 parallel.expert=1 ... train.grad_accum=4 ...

The first line is what the file itself sets, for N nodes of 8 GPUs with 80 GB; the second overrides it
for one GPU. tests/test_plan.py checks both against the planner; `python -m launch.local CONFIG
--single-gpu` applies the second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import ConfigError

NODES_PREFIX = "# 8x80GB nodes: "
SINGLE_GPU_PREFIX = "# single-gpu (80-141 GB): "


@dataclass
class Layouts:
    nodes: int | None = None  # 8-GPU nodes of the 8x80GB layout
    multi_node: list[str] | None = None
    single_gpu: list[str] | None = None


def read_layouts(path: str | os.PathLike) -> Layouts:
    """The layout lines of the config's leading comment block (None where a line is missing)."""
    found = Layouts()
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(NODES_PREFIX):
            count, _, rest = line[len(NODES_PREFIX):].partition(" ")
            if count.isdigit():
                found.nodes, found.multi_node = int(count), rest.split()
        elif line.startswith(SINGLE_GPU_PREFIX):
            found.single_gpu = line[len(SINGLE_GPU_PREFIX):].split()
    return found


def single_gpu_overrides(path: str | os.PathLike) -> list[str]:
    """The single-GPU layout's overrides; ConfigError when the config has none."""
    overrides = read_layouts(path).single_gpu
    if overrides is None:
        raise ConfigError(f"{path} has no {SINGLE_GPU_PREFIX.strip()!r} line in its header (the size configs "
                          "under configs/ have one); pass the parallel.* and train.* overrides yourself")
    return overrides


def one_gpu_hint(error: Exception, path: str | os.PathLike | None, world: int, flag: str | None = "--single-gpu"
                 ) -> str:
    """What to add to a layout error on one process: how to apply the config header's single-GPU
    layout (the command's `flag`, or with none the overrides themselves); "" for other errors."""
    from pretrain.config import LayoutError

    fits = isinstance(error, LayoutError) and world == 1 and path and Path(path).is_file()
    overrides = read_layouts(path).single_gpu if fits else None
    if overrides is None:
        return ""
    return (f" (on one GPU, {flag} applies the config header's layout)" if flag else
            f" (on one GPU, the config header's layout: {' '.join(overrides)})")
