"""Callbacks the trainer runs for a config: telemetry that depends on the model's kind, profiling."""

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
    if cfg.profile.start_step:
        from pretrain.profiling import ProfilerCallback

        p = cfg.profile
        callbacks.append(ProfilerCallback(cfg.run.dir, p.start_step, p.steps, p.ranks, p.memory))
    return callbacks
