"""Callbacks the trainer runs for every config: telemetry that depends on the model's kind."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.trainer import Callback


def build_callbacks(cfg: Config) -> list[Callback]:
    callbacks: list[Callback] = []
    return callbacks
