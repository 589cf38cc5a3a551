"""A callback of a user's own, as run.callbacks names one: it writes what the hooks saw (rank 0)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from pretrain.trainer import Callback


class HookRecorder(Callback):
    def __init__(self, cfg):
        self.path = Path(cfg.run.dir) / "user_callback.jsonl"

    def _write(self, record: dict) -> None:
        if dist.get_rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_step_end(self, trainer, result) -> None:
        self._write({"step": result.step, "loss": result.loss, "logged": sorted(result.metrics or {})})

    def on_evaluate(self, trainer, step, val) -> None:
        self._write({"step": step, "val": val})


def not_a_callback(cfg):
    return object()
