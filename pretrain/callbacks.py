"""Callbacks the trainer runs for every config: telemetry that depends on the model's kind."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.trainer import Callback


def build_callbacks(cfg: Config) -> list[Callback]:
    callbacks: list[Callback] = []
    if cfg.model.mlp != "dense":
        from models.moe.telemetry import RoutingTelemetry

        callbacks.append(RoutingTelemetry())  # routing/ scalars and the aux-loss-free bias update
    return callbacks
