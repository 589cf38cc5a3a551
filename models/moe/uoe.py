"""Union-of-Experts (UoE): experts route themselves by the norm of their routing neurons, and the
routing neurons of all experts together form a virtual shared expert (VSE).

Expert i = [N_s routing neurons | D_e rest neurons] (SwiGLU). model.moe.sizing says what
expert_hidden_size counts: the D_e rest neurons (additive: an expert holds N_s + D_e) or all of
them (carved: N_s of the expert_hidden_size are routing neurons, D_e = expert_hidden_size - N_s).
For every token:
  z_i = x G_i, h_i = silu(z_i) * (x P_i)                      (all experts, one dense SwiGLU)
  s_i = ||a_i||_2 in fp32, a_i in {h_i, silu(z_i), z_i}        (model.moe.score = h | silu | z)
  I = top-k(s), w = softmax(s[I])
  y_vse = sum_i c_i (h_i O_i), c_i = 1 (disjoint) or 1 + w_i [i in I, not dropped by capacity] (overlap)
  y_r   = sum_{i in I} w_i SwiGLU'_i(x)                         (the D_e rest neurons, expert parallel)
  y = y_vse + y_r

Layout: the VSE is one SwiGLU of width N * N_s whose neuron j belongs to expert j // N_s (rows of
`vse_in` interleave gate/up per neuron, as in models.layers.SwiGLU). It is a dense (data-parallel)
module; only the rest neurons live in the expert-parallel `experts` container.

Tensor parallelism: the VSE is column/row split over TP like any SwiGLU, so each rank holds a
contiguous slice of the N * N_s neurons (which may cut an expert's block). Every rank computes
fp32 sums of squares of its neurons per expert, [T, N], and these are all-reduced over TP (a
[T, N] fp32 all-reduce; backward is the identity since each partial only depends on local
neurons). The combine weights enter TP-partial computations (rest experts, overlap scale), so
their gradient is all-reduced over TP (copy-to-TP-region). Scores, selection and weights are
therefore identical on all TP ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from models.config import ConfigError, ModelConfig
from models.layers import column_linear, gate_and_up, row_linear, swiglu, swiglu_kept, tp_size
from models.moe.experts import ExpertContainer
from models.moe.routing import (
    SCORES,
    VSE_MODES,
    RoutedLayer,
    dispatch_activations,
    expert_params,
    is_sparse_layer,
    scores_from_norms,
    validate_routed,
)
from models.registry import ActivationLayout, MLPKind, ParallelSizes, register_mlp

SIZINGS = ("additive", "carved")


class UnionOfExperts(RoutedLayer):
    def __init__(self, cfg: ModelConfig, layer: int, ep_size: int | None = None):
        super().__init__(cfg, layer)
        moe = cfg.moe
        self.score = moe.score
        self.vse_mode = moe.vse_mode
        self.routing_neurons = moe.resolved_routing_neurons()
        width = self.num_experts * self.routing_neurons
        assert self.score in SCORES and self.vse_mode in VSE_MODES and width > 0 and width % tp_size() == 0, \
            f"UoE score={self.score} vse_mode={self.vse_mode} width={width} at TP={tp_size()} (validate_model)"
        self.vse_in = column_linear(cfg, cfg.hidden_size, 2 * width)
        self.vse_out = row_linear(cfg, width, cfg.hidden_size)
        self.experts = ExpertContainer(cfg, self.num_experts, moe.rest_neurons(), ep_size)
        local = width // tp_size()
        start = ps.get_tensor_model_parallel_rank() * local
        self.register_buffer("neuron_expert", (torch.arange(start, start + local) // self.routing_neurons),
                             persistent=False)
        # This rank's neurons as whole experts (always at TP 1): experts first..first + count - 1,
        # reduced and scaled through a [tokens, experts, N_s] view instead of index_add / index_select
        # over the neurons (in the H200 profile of a UoE step, index_add took 4%: these and the combine's).
        self.whole_experts = holds_whole_experts(width, self.routing_neurons, tp_size())
        self.first_expert, self.local_experts = start // self.routing_neurons, local // self.routing_neurons

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gate_up, _ = self.vse_in(x)
        h = swiglu(gate_up)  # eagerly on a GPU one kernel, as the experts' (models.layers.swiglu)
        if self.score == "h":
            a = h
        else:
            z, _ = gate_and_up(gate_up)
            a = F.silu(z) if self.score == "silu" else z
        sq = self.square_sums(a)
        if tp_size() > 1:
            sq = reduce_from_tensor_model_parallel_region(sq)
        scores = scores_from_norms(sq)
        valid = None if token_mask is None else token_mask.reshape(-1)
        expert_ids, _, weights = self.route(scores, valid=valid)
        if tp_size() > 1:
            weights = copy_to_tensor_model_parallel_region(weights)
        if self.vse_mode == "overlap":  # kept assignments only: a capacity-dropped one adds no scale
            kept = expert_ids >= 0
            scale = torch.ones_like(scores).scatter_add(1, expert_ids.clamp(min=0), weights * kept)
            h = self.scale_neurons(h, scale.to(h.dtype))
        y_vse, _ = self.vse_out(h)
        routed_in = copy_to_tensor_model_parallel_region(x) if tp_size() > 1 else x
        y_r = self.experts(routed_in, expert_ids, weights, self.may_drop())
        if tp_size() > 1:
            y_r = reduce_from_tensor_model_parallel_region(y_r)
        if self.training and self.stats.measure_norms:
            vse, routed = (y_vse, y_r) if valid is None else (y_vse * valid[:, None], y_r * valid[:, None])
            self.record(norms=True, vse_norm=vse, routed_norm=routed)  # of the real tokens
        return (y_vse + y_r).view(shape)

    def square_sums(self, a: torch.Tensor) -> torch.Tensor:
        """[T, local neurons] -> fp32 [T, num_experts]: the sum of squares over each expert's
        neurons on this rank (zero for experts with none here). Both ways keep nothing for backward
        beyond a itself (index_add of fp32 squares would keep them: 4 bytes per routing neuron and
        token, twice)."""
        T = a.shape[0]
        if self.whole_experts:
            per_expert = a.view(T, self.local_experts, self.routing_neurons)
            sums = torch.linalg.vector_norm(per_expert, dim=-1, dtype=torch.float32).square()
            after = self.num_experts - self.first_expert - self.local_experts
            return F.pad(sums, (self.first_expert, after)) if self.first_expert or after else sums
        return SquareSums.apply(a, self.neuron_expert, self.num_experts)

    def scale_neurons(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """h [T, local neurons] times each neuron's expert's entry of scale [T, num_experts]."""
        if self.whole_experts:
            mine = scale[:, self.first_expert:self.first_expert + self.local_experts, None]
            return (h.view(h.shape[0], self.local_experts, self.routing_neurons) * mine).view(h.shape)
        return h * scale.index_select(1, self.neuron_expert)  # see dispatch_combine's gathers


class SquareSums(torch.autograd.Function):
    """fp32 sums of squares of a [T, neurons] over each expert's neurons (neuron_expert [neurons]:
    each neuron's expert) -> [T, num_experts], keeping only a for backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, neuron_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
        ctx.save_for_backward(a, neuron_expert)
        sums = torch.zeros(a.shape[0], num_experts, dtype=torch.float32, device=a.device)
        return sums.index_add_(1, neuron_expert, a.float().square())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, neuron_expert = ctx.saved_tensors
        return (2 * a.float() * grad.index_select(1, neuron_expert)).to(a.dtype), None, None


def holds_whole_experts(routing_neurons: int, per_expert: int, tensor: int) -> bool:
    """Whether each tensor-parallel rank's share of the routing neurons is whole experts."""
    return routing_neurons // tensor % per_expert == 0


def rest_params(cfg: ModelConfig) -> int:
    """The expert-parallel part of one layer: the rest neurons of all experts."""
    return expert_params(cfg, cfg.moe.rest_neurons())


def params(cfg: ModelConfig) -> tuple[int, int]:
    moe, d = cfg.moe, cfg.hidden_size
    vse = 3 * d * moe.num_experts * moe.resolved_routing_neurons()
    return vse + rest_params(cfg), vse + moe.top_k * 3 * d * moe.rest_neurons()


def validate(cfg: ModelConfig, sizes: ParallelSizes) -> None:
    moe = cfg.moe
    if moe.sizing not in SIZINGS:
        raise ConfigError(f"model.moe.sizing={moe.sizing!r}: choose {' or '.join(SIZINGS)}")
    if moe.num_experts < 1:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 1")
    routing, rest = moe.resolved_routing_neurons(), moe.rest_neurons()
    if rest < 1 and moe.sizing == "carved":
        raise ConfigError(
            f"model.moe.sizing=carved takes N_s={routing} routing neurons out of expert_hidden_size="
            f"{moe.expert_hidden_size}, which leaves none: raise expert_hidden_size or lower routing_neurons"
        )
    if rest < 1:
        raise ConfigError(f"model.moe.expert_hidden_size={moe.expert_hidden_size} must be >= 1")
    width_key = "expert_hidden_size" if moe.sizing == "additive" else "expert_hidden_size - routing_neurons"
    validate_routed(cfg, sizes, {width_key: rest}, expert_width=rest)
    if routing < 1:
        raise ConfigError(
            "model.mlp=uoe needs routing neurons: set model.moe.routing_neurons, or "
            f"model.moe.shared_hidden_size >= num_experts={moe.num_experts} (N_s = shared // experts)"
        )
    if not moe.routing_neurons and moe.shared_hidden_size % moe.num_experts:
        raise ConfigError(
            f"model.moe.shared_hidden_size={moe.shared_hidden_size} is not a multiple of num_experts="
            f"{moe.num_experts}, so N_s = shared // experts would quietly narrow the virtual shared expert to "
            f"{routing * moe.num_experts}: choose a multiple, or set model.moe.routing_neurons"
        )
    if moe.router_z_loss_coef:
        raise ConfigError(f"model.moe.router_z_loss_coef={moe.router_z_loss_coef}: UoE has no router; it applies "
                          "to model.mlp=moe only (set it to 0)")
    if routing * moe.num_experts % sizes.tensor:
        raise ConfigError(
            f"UoE virtual shared expert width {routing * moe.num_experts} (num_experts x routing neurons) "
            f"is not divisible by parallel.tensor={sizes.tensor}"
        )


def activations(cfg: ModelConfig, layout: ActivationLayout) -> float:
    """Elements per token kept for backward: the SwiGLU's per active neuron (models.layers.swiglu_kept)
    and the dispatch's copies; per routing neuron, besides its SwiGLU's, in overlap mode the weighted
    product, what scores the experts (the silu activations, with score=silu), and where a
    tensor-parallel rank holds parts of experts, in overlap mode the routing weights spread over
    the neurons."""
    moe, tensor = cfg.moe, layout.tensor
    per_expert = moe.resolved_routing_neurons()
    routing_neurons = moe.num_experts * per_expert
    whole_experts = not per_expert or holds_whole_experts(routing_neurons, per_expert, tensor)  # 0: invalid
    overlap = moe.vse_mode == "overlap"
    scoring = (moe.score == "silu") + (0 if whole_experts else overlap)
    swiglu_elements = swiglu_kept(layout.fused_swiglu)
    per_routing_neuron = swiglu_elements + overlap + scoring
    routed = swiglu_elements * moe.top_k * moe.rest_neurons() + per_routing_neuron * routing_neurons
    return routed / tensor + dispatch_activations(cfg)


def signature(cfg: ModelConfig) -> dict:
    """What fixes the layers: the routing and rest neurons as built (routing_neurons=0 and
    shared_hidden_size / num_experts, or carved and additive sizing, can spell the same layer)."""
    moe = cfg.moe
    return {"moe.num_experts": moe.num_experts, "moe.top_k": moe.top_k, "moe.moe_layers": moe.moe_layers,
            "moe.routing_neurons (N_s as built)": moe.resolved_routing_neurons(),
            "moe.expert_hidden_size (rest neurons by sizing)": moe.rest_neurons(),
            "moe.score": moe.score, "moe.vse_mode": moe.vse_mode}


register_mlp(MLPKind(
    name="uoe", module=UnionOfExperts, params=params, expert_params=rest_params, routed=True,
    activations=activations,
    applies_to=is_sparse_layer, validate=validate, hf_remote=True, sections=("moe",), signature=signature,
))
