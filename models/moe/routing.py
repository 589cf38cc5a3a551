"""Top-k selection, Switch load-balancing loss, aux-loss-free bias, capacity dropping and the
routing statistics shared by the router MoE and Union-of-Experts layers.

Conventions (documented choices):
* combine weights: w = softmax(s[top-k]) over the selected scores. For the router MoE this is
  the same as softmax over all experts, then top-k, then renormalising the k weights.
* aux loss (Switch / Megatron normalisation): coef * N / K * sum_i f_i * P_i with
  f_i = (assignments to i) / T and P_i = mean_t softmax(s_t)[i], on this rank's tokens of the
  micro-batch. A perfectly balanced router gives exactly `coef`. coef = 0 turns it off.
* aux-loss-free bias (DeepSeek-V3): b is added to the scores for selection only; weights and the
  aux loss use the unbiased scores. After every optimizer step b_i += rate * sign(mean - n_i),
  with n_i the tokens routed to i since the last update, summed over the data-parallel group.
  With rate 0 the bias stays as it is (zero unless an earlier phase of the run learned it).
* capacity factor c > 0: every expert keeps its first ceil(T * K / N * c) assignments in token
  order (this rank's tokens); the rest are dropped (contribute nothing) and counted.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import nn

from models.config import ModelConfig
from models.moe.dispatch import capacity_mask


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside the backward pass."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def switch_aux_loss(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, coef: float) -> torch.Tensor:
    probs = torch.softmax(scores.float(), dim=-1)
    T, k = expert_ids.shape
    counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts).float()
    return coef * num_experts / k * torch.sum((counts / T) * probs.mean(0))


class RoutingStats:
    """Training-forward sums since the last read: tokens per expert, dropped assignments, score sums,
    aux loss and (UoE) output norms."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.num_experts, dtype=torch.float64)
        self.score_sum = torch.zeros(self.num_experts, dtype=torch.float64)
        self.tokens = 0.0
        self.dropped = 0.0
        self.assignments = 0.0
        self.aux = 0.0
        self.forwards = 0.0
        self.vse_norm = 0.0
        self.routed_norm = 0.0

    def as_tensor(self) -> torch.Tensor:
        scalars = torch.tensor([self.tokens, self.dropped, self.assignments, self.aux, self.forwards,
                                self.vse_norm, self.routed_norm], dtype=torch.float64)
        return torch.cat([self.counts, self.score_sum, scalars])


class RoutedLayer(nn.Module):
    """Base of the sparse MLPs: selection, aux loss, bias, capacity and statistics."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        moe = cfg.moe
        self.layer = layer
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.aux_loss_coef = moe.aux_loss_coef
        self.bias_update_rate = moe.bias_update_rate
        self.capacity_factor = moe.capacity_factor
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        # Persistent so that a resumed run selects exactly as before; all zeros when unused.
        self.register_buffer("router_bias", torch.zeros(self.num_experts), persistent=True)
        self.register_buffer("pending_counts", torch.zeros(self.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.stats = RoutingStats(self.num_experts)
        self.last_dropped = 0

    def route(self, scores: torch.Tensor, stat_scores: torch.Tensor | None = None):
        """scores: fp32 [T, N] (higher = better). Returns (expert_ids [T, K] with -1 for dropped,
        selected ids [T, K], weights fp32 [T, K]). `stat_scores` replaces `scores` in the telemetry."""
        T = scores.shape[0]
        # The bias is model state: once learned it keeps steering selection, also with updates off.
        selection = scores.detach() + self.router_bias
        selected = selection.topk(self.top_k, dim=-1).indices
        weights = torch.softmax(scores.gather(-1, selected), dim=-1)
        if self.training and self.aux_loss_coef > 0:
            self.aux_loss = switch_aux_loss(scores, selected, self.num_experts, self.aux_loss_coef)
        else:
            self.aux_loss = None
        expert_ids = selected
        dropped = 0
        if self.capacity_factor > 0:
            capacity = math.ceil(T * self.top_k / self.num_experts * self.capacity_factor)
            keep = capacity_mask(selected.reshape(-1), self.num_experts, capacity).view_as(selected)
            expert_ids = torch.where(keep, selected, torch.full_like(selected, -1))
            dropped = int((~keep).sum())
        self.last_dropped = dropped
        if self.training and not recomputing():  # count each training forward once
            with torch.no_grad():
                counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts)
                if self.bias_update_rate > 0:
                    self.pending_counts += counts.to(self.pending_counts.dtype)
                s = self.stats
                s.counts += counts.double().cpu()
                s.score_sum += (scores if stat_scores is None else stat_scores).detach().double().sum(0).cpu()
                s.tokens += T
                s.assignments += T * self.top_k
                s.dropped += dropped
                s.forwards += 1
                if self.aux_loss is not None:
                    s.aux += float(self.aux_loss.detach())
        return expert_ids, selected, weights

    @torch.no_grad()
    def update_bias(self) -> None:
        """Collective over the data-parallel group; call on every rank after the optimizer step."""
        if self.bias_update_rate <= 0:
            return
        counts = self.pending_counts.clone()
        if dist.is_initialized() and ps.model_parallel_is_initialized():
            dist.all_reduce(counts, group=ps.get_data_parallel_group())
        self.router_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.pending_counts.zero_()


def sparse_layers(model: nn.Module) -> list[RoutedLayer]:
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]


def scores_from_norms(sq: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 norms from fp32 sums of squares; eps keeps the gradient finite at zero."""
    return torch.sqrt(sq + eps)


__all__ = ["RoutedLayer", "RoutingStats", "switch_aux_loss", "sparse_layers", "scores_from_norms"]
