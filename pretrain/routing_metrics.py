"""Routing telemetry of the sparse (MoE / UoE) layers, as a trainer callback.

On log steps the routing statistics gathered by the training forwards since the last log step
(models.moe.routing.RoutingStats) are summed over the data-parallel group and written to
TensorBoard under routing/layer{L}/...:
  load_e{i}          fraction of the layer's token->expert assignments that went to expert i
  load_entropy       entropy of that distribution / log(N) (1 = perfectly balanced)
  max_load           max over experts of load / mean load (1 = perfectly balanced)
  dropped_tokens     assignments dropped by the capacity factor (0 when dropless)
  dropped_frac       dropped / assignments
  score_e{i}         mean routing score of expert i (UoE: activation norm; MoE: router probability)
  aux_loss           mean Switch aux loss per micro-batch (not logged when the coef is 0)
  router_z_loss      mean router z-loss per micro-batch (router MoE with model.moe.router_z_loss_coef > 0)
  vse_over_routed    ||y_vse|| / ||y_r|| (UoE only)
plus routing/load_entropy and routing/max_load averaged / maximised over layers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.moe.routing import RoutedLayer, RoutingStats
from pretrain.trainer import Callback


def summarize(layer: RoutedLayer, totals: torch.Tensor) -> dict[str, float]:
    n = layer.num_experts
    counts, score_sum = totals[:n], totals[n:2 * n]
    sums = RoutingStats.named(totals, n)
    tokens, dropped, assignments = sums["tokens"], sums["dropped"], sums["assignments"]
    aux, forwards, vse_norm, routed_norm = sums["aux"], sums["forwards"], sums["vse_norm"], sums["routed_norm"]
    out: dict[str, float] = {}
    if assignments <= 0:
        return out
    frac = counts / counts.sum().clamp_min(1)
    for i in range(n):
        out[f"load_e{i}"] = float(frac[i])
        out[f"score_e{i}"] = float(score_sum[i] / max(tokens, 1))
    nz = frac[frac > 0]
    out["load_entropy"] = float(-(nz * nz.log()).sum() / math.log(n)) if n > 1 else 1.0
    out["max_load"] = float(frac.max() * n)
    out["dropped_tokens"] = dropped
    out["dropped_frac"] = dropped / assignments
    if layer.aux_loss_coef > 0 and forwards > 0:
        out["aux_loss"] = aux / forwards
    if getattr(layer, "router_z_loss_coef", 0) > 0 and forwards > 0:
        out["router_z_loss"] = sums["router_z"] / forwards
    if routed_norm > 0:
        out["vse_over_routed"] = vse_norm / routed_norm
    return out


class RoutingTelemetry(Callback):
    def __init__(self, layers: list[RoutedLayer]):
        self.layers = layers

    def on_step_begin(self, trainer, step) -> None:
        t = trainer.cfg.train
        log_step = step % t.log_interval == 0 or step == t.steps  # the steps whose metrics are read
        for layer in self.layers:
            layer.stats.measure_norms = log_step

    def on_step_end(self, trainer, result) -> None:
        if result.metrics:
            trainer.logger.scalars(result.step, self.collect(self.layers), prefix="routing/")

    @staticmethod
    def collect(layers: list[RoutedLayer]) -> dict[str, float]:
        """Collective over the data-parallel group; resets the layers' statistics."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        stacked = torch.cat([layer.stats.as_tensor(device) for layer in layers])
        if dist.is_initialized() and ps.model_parallel_is_initialized():
            dist.all_reduce(stacked, group=ps.get_data_parallel_group())
        # Sums over DP; the reported aux loss and norm ratio are ratios of two such sums.
        stacked = stacked.cpu()
        metrics: dict[str, float] = {}
        offset = 0
        entropies, max_loads = [], []
        for layer in layers:
            size = RoutingStats.size(layer.num_experts)
            totals = stacked[offset: offset + size]
            offset += size
            summary = summarize(layer, totals)
            layer.stats.reset()
            for key, value in summary.items():
                metrics[f"layer{layer.layer}/{key}"] = value
            if "load_entropy" in summary:
                entropies.append(summary["load_entropy"])
                max_loads.append(summary["max_load"])
        if entropies:
            metrics["load_entropy"] = sum(entropies) / len(entropies)
            metrics["max_load"] = max(max_loads)
        return metrics
