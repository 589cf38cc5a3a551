"""Classic top-k MoE: a learned linear router (logits in fp32), optional shared expert, routed SwiGLU experts.

Router: logits = x W_r^T in fp32 (W_r in the training precision, bf16 on GPUs), p = softmax(logits)
over all N experts, top-k on log p (+ the aux-loss-free bias when enabled: it multiplies p by e^bias
for selection), weights = the k selected probabilities renormalised to sum to 1
(identical to softmax over the k selected logits). The Switch aux loss uses p; the optional router
z-loss (model.moe.router_z_loss_coef) is coef x mean over tokens of logsumexp(logits)^2.
The router weight is replicated over tensor-parallel ranks (every TP rank routes the same tokens);
the shared expert is an ordinary TP-split SwiGLU of width model.moe.shared_hidden_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from models.config import ConfigError, ModelConfig
from models.layers import SwiGLU, swiglu_kept, tp_size
from models.moe.experts import ExpertContainer
from models.moe.routing import (
    RoutedLayer,
    dispatch_activations,
    expert_params,
    is_sparse_layer,
    validate_routed,
)
from models.registry import ActivationLayout, MLPKind, ParallelSizes, register_mlp


class RouterMoE(RoutedLayer):
    def __init__(self, cfg: ModelConfig, layer: int, ep_size: int | None = None):
        super().__init__(cfg, layer)
        moe = cfg.moe
        self.router_z_loss_coef = moe.router_z_loss_coef
        self.router = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        nn.init.normal_(self.router, mean=0.0, std=cfg.init_std)
        self.shared = SwiGLU(cfg, moe.shared_hidden_size) if moe.shared_hidden_size > 0 else None
        self.experts = ExpertContainer(cfg, self.num_experts, moe.expert_hidden_size, ep_size)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        valid = None if token_mask is None else token_mask.reshape(-1)
        logits = F.linear(x.float(), self.router.float())
        probs = torch.softmax(logits, dim=-1)
        # route() takes softmax over the selected scores; on log-probabilities that is exactly the
        # renormalised top-k of p, and the aux loss's softmax of log p is p itself.
        # The bias (when enabled) is thus added to log p for selection; telemetry reports p.
        expert_ids, _, weights = self.route(torch.log_softmax(logits, dim=-1), stat_scores=probs, valid=valid)
        if self.training and self.router_z_loss_coef > 0:
            z = torch.logsumexp(logits, dim=-1).square()
            z = z.mean() if valid is None else (z * valid).sum() / valid.sum().clamp_min(1)
            z = self.router_z_loss_coef * z
            self.aux_loss = z if self.aux_loss is None else self.aux_loss + z
            self.record(router_z=z.detach())
        if tp_size() > 1:
            weights = copy_to_tensor_model_parallel_region(weights)
        routed_in = copy_to_tensor_model_parallel_region(x) if tp_size() > 1 else x
        y = self.experts(routed_in, expert_ids, weights, self.may_drop())
        if tp_size() > 1:
            y = reduce_from_tensor_model_parallel_region(y)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)


def params(cfg: ModelConfig) -> tuple[int, int]:
    moe, d = cfg.moe, cfg.hidden_size
    shared_and_router = 3 * d * moe.shared_hidden_size + d * moe.num_experts
    active_experts = moe.top_k * 3 * d * moe.expert_hidden_size
    return shared_and_router + expert_params(cfg), shared_and_router + active_experts


def validate(cfg: ModelConfig, sizes: ParallelSizes) -> None:
    moe = cfg.moe
    if moe.sizing != "additive":
        raise ConfigError(f"model.moe.sizing={moe.sizing!r} sizes Union-of-Experts routing neurons; a router "
                          "MoE has none: leave it at additive (or use model.mlp=uoe)")
    if moe.expert_hidden_size < 1:
        raise ConfigError(f"model.moe.expert_hidden_size={moe.expert_hidden_size} must be >= 1")
    if moe.shared_hidden_size < 0:
        raise ConfigError(f"model.moe.shared_hidden_size={moe.shared_hidden_size} must be >= 0 "
                          "(0: no shared expert)")
    validate_routed(cfg, sizes, {"expert_hidden_size": moe.expert_hidden_size,
                                 "shared_hidden_size": moe.shared_hidden_size})


def activations(cfg: ModelConfig, layout: ActivationLayout) -> float:
    """Elements per token kept for backward: the SwiGLUs of the top_k experts and the shared expert,
    and the dispatch's copies."""
    active_neurons = cfg.moe.top_k * cfg.moe.expert_hidden_size + cfg.moe.shared_hidden_size
    return swiglu_kept(layout.fused_swiglu) * active_neurons / layout.tensor + dispatch_activations(cfg)


def signature(cfg: ModelConfig) -> dict:
    """The keys a router MoE reads (model.moe's Union-of-Experts keys are not among them)."""
    keys = ("num_experts", "top_k", "expert_hidden_size", "shared_hidden_size", "moe_layers")
    return {f"moe.{key}": getattr(cfg.moe, key) for key in keys}


register_mlp(MLPKind(
    name="moe", module=RouterMoE, params=params, expert_params=expert_params, routed=True,
    activations=activations,
    applies_to=is_sparse_layer, validate=validate, hf_remote=True, sections=("moe",), signature=signature,
))
