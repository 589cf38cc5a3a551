"""The callbacks a run trains with: routing telemetry when the model has routed layers,
attention-sink metrics, downstream accuracy and profiling when asked for, and run.callbacks."""

from __future__ import annotations

from torch import nn

from models.moe.routing import sparse_layers
from pretrain.config import Config, ConfigError, resolve_callback
from pretrain.trainer import Callback


def build_callbacks(cfg: Config, model: nn.Module) -> list[Callback]:
    from pretrain.sink_metrics import SinkMetricsCallback

    callbacks: list[Callback] = []
    routed = sparse_layers(model)
    if routed:
        from pretrain.routing_metrics import RoutingTelemetry

        callbacks.append(RoutingTelemetry(routed))  # routing/ scalars
    # Attention-sink metrics (alpha_1, Sink_1^0.3) on the fixed validation batch at every evaluation.
    per_head = cfg.model.num_heads * cfg.model.num_layers <= 256  # per-head scalars only for small models
    callbacks.append(SinkMetricsCallback(per_head=per_head))
    if cfg.eval.downstream_interval:
        from pretrain.downstream_metrics import DownstreamEval

        callbacks.append(DownstreamEval(cfg))  # downstream/ accuracies
    if cfg.eval.sample_prompts:
        from pretrain.generation_samples import GenerationSamples

        callbacks.append(GenerationSamples(cfg))  # samples/ texts
    if cfg.profile.start_step:
        from pretrain.profiling import ProfilerCallback

        p = cfg.profile
        callbacks.append(ProfilerCallback(cfg.run.dir, p.start_step, p.steps, p.ranks, p.memory))
    for spec in cfg.run.callbacks:  # the user's, after the built-in ones (their metrics are set by then)
        callback = resolve_callback(spec)(cfg)
        if not isinstance(callback, Callback):
            raise ConfigError(f"run.callbacks entry {spec!r} gave a {type(callback).__name__}, not a "
                              "pretrain.trainer.Callback: subclass it and override the hooks you need")
        callbacks.append(callback)
    return callbacks
