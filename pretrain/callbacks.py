"""Callbacks the trainer runs for every config: telemetry that depends on the model's kind."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.trainer import Callback


def build_callbacks(cfg: Config) -> list[Callback]:
    from pretrain.sink_report import SinkMetricsCallback

    callbacks: list[Callback] = []
    if cfg.model.mlp != "dense":
        from models.moe.telemetry import RoutingTelemetry

        callbacks.append(RoutingTelemetry())  # routing/ scalars
    # Attention-sink metrics (alpha_1, Sink_1^0.3) on the fixed validation batch at every evaluation.
    per_head = cfg.model.num_heads * cfg.model.num_layers <= 256  # per-head scalars only for small models
    callbacks.append(SinkMetricsCallback(cfg.train.eval_interval, per_head=per_head))
    return callbacks
