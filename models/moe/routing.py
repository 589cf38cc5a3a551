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
* padding (a token mask, as post-training's padded batches give): T counts the real tokens only,
  and padding takes no part in the aux loss, the bias counts, capacity or the statistics. Dropless,
  padding is still computed (its outputs reach nothing real); with capacity it is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import nn

from models.config import ConfigError, ModelConfig, index_set, parse_indices, parse_switch
from models.moe.dispatch import capacity_mask, expert_counts
from models.registry import ParallelSizes, register_section

# Where model.moe.grouped_gemm=auto runs grouped GEMMs: GPUs of compute capability 9.x (Hopper),
# where torch._grouped_mm is one fused kernel and was measured (the 1B UoE trained 1.37x as fast as
# with a GEMM pair per expert on an H200), in bf16. An A100 runs it as a loop over the groups that
# waits for the device; newer GPUs are unmeasured (true runs them grouped anyway).
GROUPED_GEMM_FUSED_MAJOR = 9


def grouped_gemm_problem(hidden: int, local_width: int) -> str | None:
    """What keeps torch._grouped_mm from these sizes (it needs 16-byte aligned bf16 rows), naming
    the fix; None when nothing does."""
    if not hasattr(torch, "_grouped_mm"):
        return "model.moe.grouped_gemm=true needs torch._grouped_mm (torch >= 2.8); set it to false"
    for name, size in (("model.hidden_size", hidden), ("expert width per tensor-parallel rank", local_width)):
        if size % 8:
            return (f"model.moe.grouped_gemm=true: {name}={size} must be a multiple of 8 "
                    "(torch.bfloat16); change it or set model.moe.grouped_gemm=false")
    return None


@dataclass(frozen=True)
class GroupedGemm:
    """model.moe.grouped_gemm resolved for a device: whether routed experts run as grouped GEMMs."""
    enabled: bool = False
    bf16_only: bool = False  # auto: torch._grouped_mm's fused kernel was measured in bf16 only

    def runs(self, bf16: bool) -> bool:
        """Whether they do for inputs in bf16 (True) or in another type."""
        return self.enabled and (bf16 or not self.bf16_only)


def grouped_gemm_mode(setting: str, compute_capability: tuple[int, int] | None, hidden: int,
                      local_width: int) -> GroupedGemm:
    """model.moe.grouped_gemm on a device (compute_capability None: no GPU) for experts of
    local_width neurons per tensor-parallel rank. true: grouped in any type (its sizes are checked
    by validate_routed); false: never; auto: in bf16 on Hopper GPUs where the sizes allow."""
    setting = parse_switch(setting, "model.moe.grouped_gemm")  # also a boolean assigned in code
    if setting != "auto":
        return GroupedGemm(enabled=setting == "true")
    if grouped_gemm_problem(hidden, local_width):
        return GroupedGemm()
    hopper = compute_capability is not None and compute_capability[0] == GROUPED_GEMM_FUSED_MAJOR
    return GroupedGemm(enabled=True, bf16_only=True) if hopper else GroupedGemm()


SCORES = ("h", "silu", "z")
VSE_MODES = ("overlap", "disjoint")


@dataclass
class MoEConfig:
    """model.moe: shared by the top-k router MoE and Union-of-Experts layers."""

    num_experts: int = 4
    top_k: int = 2
    expert_hidden_size: int = 128  # D_e: ordinary (routed) neurons per expert
    shared_hidden_size: int = 0  # MoE: width of the shared expert (0 = none)
    routing_neurons: int = 0  # UoE: N_s per expert; 0 = shared_hidden_size // num_experts
    # UoE: additive = an expert is N_s routing + expert_hidden_size rest neurons; carved = the first
    # N_s of its expert_hidden_size neurons are the routing ones.
    sizing: str = "additive"
    score: str = "h"  # UoE routing-neuron activation scored: h | silu | z
    vse_mode: str = "overlap"  # UoE virtual shared expert: overlap | disjoint
    aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0  # router MoE: coef x mean(logsumexp(router logits)^2); 0 = off
    bias_update_rate: float = 0.0  # aux-loss-free balancing; 0 = off
    capacity_factor: float = 0.0  # training only: 0 = dropless (evaluation and inference always are)
    moe_layers: str = field(default="all", metadata={"parse": parse_indices})  # "all" or layer indices
    # Run each rank's experts as two grouped GEMMs (torch._grouped_mm): auto | true | false
    # (auto: in bf16 on Hopper GPUs, where the sizes allow; see grouped_gemm_mode).
    grouped_gemm: str = field(default="auto", metadata={"parse": parse_switch})

    def __post_init__(self):  # set in code (MoEConfig(grouped_gemm=True)) as from a file
        self.grouped_gemm = parse_switch(self.grouped_gemm, "model.moe.grouped_gemm")
        self.moe_layers = parse_indices(self.moe_layers, "model.moe.moe_layers")

    def resolved_routing_neurons(self) -> int:
        """UoE routing neurons per expert (N_s)."""
        return self.routing_neurons or self.shared_hidden_size // self.num_experts

    def rest_neurons(self) -> int:
        """UoE neurons per expert besides its routing neurons (the expert-parallel part)."""
        if self.sizing == "carved":
            return self.expert_hidden_size - self.resolved_routing_neurons()
        return self.expert_hidden_size

    def listed_layers(self) -> set[int] | None:
        """The layers listed in moe_layers; None for "all"."""
        return index_set(self.moe_layers)


register_section("moe", MoEConfig, training_only=("aux_loss_coef", "router_z_loss_coef", "bias_update_rate",
                                                  "capacity_factor", "grouped_gemm"))


def dispatch_activations(cfg: ModelConfig) -> float:
    """Elements per token that dispatch_combine keeps for backward: the gathered expert inputs and
    the expert outputs before their routing weights, top_k rows of hidden_size each (whole on
    every tensor-parallel rank)."""
    return 2 * cfg.moe.top_k * cfg.hidden_size


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether `layer` takes the routed MLP (model.moe.moe_layers) or stays dense."""
    wanted = cfg.moe.listed_layers()
    return wanted is None or layer in wanted


def expert_params(cfg: ModelConfig, width: int | None = None) -> int:
    """The routed experts of one layer: N SwiGLUs of width D_e (or `width`)."""
    width = cfg.moe.expert_hidden_size if width is None else width
    return cfg.moe.num_experts * 3 * cfg.hidden_size * width


def validate_routed(cfg: ModelConfig, sizes: ParallelSizes, split_widths: dict[str, int],
                    expert_width: int | None = None) -> None:
    """What the router MoE and UoE layers both read; `split_widths` names the widths that
    tensor parallelism splits, `expert_width` the width of each routed expert (default D_e)."""
    moe = cfg.moe
    if moe.num_experts % sizes.expert:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.expert={sizes.expert}")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and num_experts={moe.num_experts}")
    # UoE's keys too: a router MoE ignores them, but a typo there would stay unseen
    if moe.score not in SCORES or moe.vse_mode not in VSE_MODES:
        raise ConfigError(f"model.moe.score={moe.score!r} / vse_mode={moe.vse_mode!r}: choose score "
                          f"{'|'.join(SCORES)} and vse_mode {'|'.join(VSE_MODES)}")
    if moe.routing_neurons < 0:
        raise ConfigError(f"model.moe.routing_neurons={moe.routing_neurons} must be >= 0 (0: shared_hidden_size "
                          "// num_experts)")
    for key in ("aux_loss_coef", "router_z_loss_coef"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be >= 0 (0 = off)")
    if any(width % sizes.tensor for width in split_widths.values()):
        widths = " and ".join(f"{name}={width}" for name, width in split_widths.items())
        raise ConfigError(f"model.moe.{widths} must be divisible by parallel.tensor={sizes.tensor} "
                          "(experts are TP-split)")
    if parse_switch(moe.grouped_gemm, "model.moe.grouped_gemm") == "true":
        width = moe.expert_hidden_size if expert_width is None else expert_width
        problem = grouped_gemm_problem(cfg.hidden_size, width // sizes.tensor)
        if problem:
            raise ConfigError(problem)
    if moe.capacity_factor < 0 or moe.bias_update_rate < 0:
        raise ConfigError("model.moe.capacity_factor and bias_update_rate must be >= 0 (0 = off)")
    layers = moe.listed_layers()
    if layers is not None and not all(0 <= i < cfg.num_layers for i in layers):
        raise ConfigError(f"model.moe.moe_layers={moe.moe_layers!r}: name layers between 0 and "
                          f"model.num_layers - 1 = {cfg.num_layers - 1}, or 'all'")


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside the backward pass."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def switch_aux_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int, coef: float,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """scores [T, N]; counts [N]: the assignments each expert got (expert_counts); valid: bool [T],
    the tokens that count (None: all)."""
    probs = torch.softmax(scores.float(), dim=-1)
    T, num_experts = scores.shape
    if valid is None:
        return coef * num_experts / top_k * torch.sum((counts.float() / T) * probs.mean(0))
    real = valid.sum().clamp_min(1).float()
    mean_probs = (probs * valid[:, None]).sum(0) / real
    return coef * num_experts / top_k * torch.sum((counts.float() / real) * mean_probs)


class RoutingStats:
    """Training-forward sums since the last read: tokens per expert, dropped assignments, score sums,
    aux loss and (UoE) output norms. They are summed on the device (no forward waits for the GPU)
    and read, in one collective, on log steps; only the count of forwards is kept on the host."""

    # tokens and assignments: on the device, as a token mask (padding) makes them device counts
    ON_DEVICE = ("dropped", "aux", "router_z", "vse_norm", "routed_norm", "tokens", "assignments")
    ON_HOST = ("forwards",)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.device_size = 2 * num_experts + len(self.ON_DEVICE)
        # Output norms cost two reductions over [tokens, hidden] per forward; the trainer measures
        # them only on steps whose metrics are read.
        self.measure_norms = True
        self.reset()

    def reset(self) -> None:
        self.device_sums: torch.Tensor | None = None  # float64 [counts N, score sums N, ON_DEVICE]
        self.forwards = 0

    def _sums(self, device: torch.device) -> torch.Tensor:
        if self.device_sums is None:  # on the device of the first training forward
            self.device_sums = torch.zeros(self.device_size, dtype=torch.float64, device=device)
        return self.device_sums

    def add_forward(self, counts: torch.Tensor, score_sum: torch.Tensor, tokens: int | torch.Tensor,
                    assignments: int | torch.Tensor) -> None:
        sums = self._sums(counts.device)
        sums[:self.num_experts] += counts
        sums[self.num_experts:2 * self.num_experts] += score_sum
        for name, value in (("tokens", tokens), ("assignments", assignments)):
            sums[2 * self.num_experts + self.ON_DEVICE.index(name)] += value
        self.forwards += 1

    def add(self, name: str, value: torch.Tensor) -> None:
        self._sums(value.device)[2 * self.num_experts + self.ON_DEVICE.index(name)] += value

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[counts N, score sums N, *ON_DEVICE, *ON_HOST] as float64 on `device`."""
        sums = (torch.zeros(self.device_size, dtype=torch.float64, device=device)
                if self.device_sums is None else self.device_sums.to(device))
        host = torch.tensor([self.forwards], dtype=torch.float64, device=device)
        return torch.cat([sums, host])

    def totals(self) -> dict[str, float]:
        """The sums besides the per-expert ones, by name (waits for the device)."""
        return self.named(self.as_tensor(), self.num_experts)

    @classmethod
    def named(cls, totals: torch.Tensor, num_experts: int) -> dict[str, float]:
        """The sums besides the per-expert ones of an as_tensor() layout, by name."""
        return dict(zip(cls.ON_DEVICE + cls.ON_HOST, totals[2 * num_experts:].tolist()))

    @classmethod
    def size(cls, num_experts: int) -> int:
        return 2 * num_experts + len(cls.ON_DEVICE) + len(cls.ON_HOST)


class RoutedLayer(nn.Module):
    """Base of the sparse MLPs: selection, aux loss, bias, capacity and statistics. Their forward
    takes (x [..., hidden], token_mask [...] bool or None: the real tokens, padding False)."""

    takes_token_mask = True  # models.gpt.Block passes ctx["token_mask"]

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        moe = cfg.moe
        self.layer = layer
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.aux_loss_coef = moe.aux_loss_coef
        self.bias_update_rate = moe.bias_update_rate
        self.capacity_factor = moe.capacity_factor
        assert 1 <= self.top_k <= self.num_experts, f"top_k={self.top_k} of {self.num_experts} experts"
        # Persistent so that a resumed run selects exactly as before; all zeros when unused.
        self.register_buffer("router_bias", torch.zeros(self.num_experts), persistent=True)
        self.register_buffer("pending_counts", torch.zeros(self.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.stats = RoutingStats(self.num_experts)
        self.last_dropped = 0

    def route(self, scores: torch.Tensor, stat_scores: torch.Tensor | None = None,
              valid: torch.Tensor | None = None):
        """scores: fp32 [T, N] (higher = better); valid: bool [T], the real tokens (None: all; see
        the module's docstring for padding). Returns (expert_ids [T, K] with -1 for dropped,
        selected ids [T, K], weights fp32 [T, K]). `stat_scores` replaces `scores` in the telemetry."""
        T = scores.shape[0]
        # The bias is model state: once learned it keeps steering selection, also with updates off.
        selection = scores.detach() + self.router_bias
        selected = selection.topk(self.top_k, dim=-1).indices
        weights = torch.softmax(scores.gather(-1, selected), dim=-1)
        counted = None if valid is None else valid.long().repeat_interleave(self.top_k)  # per assignment
        counts = expert_counts(selected.reshape(-1), self.num_experts, counted) if self.training else None
        if self.training and self.aux_loss_coef > 0:
            self.aux_loss = switch_aux_loss(scores, counts, self.top_k, self.aux_loss_coef, valid)
        else:
            self.aux_loss = None
        expert_ids = selected
        dropped = 0
        if self.may_drop():  # evaluation and inference route every token
            ids, experts, real = selected.reshape(-1), self.num_experts, T
            if valid is not None:  # padding queues for an expert of its own, then is dropped
                # float64, as math.ceil computes the count of an unmasked batch (float32 rounds some down)
                ids, experts = torch.where(counted.bool(), ids, experts), experts + 1
                real = valid.sum(dtype=torch.float64)
            capacity = real * self.top_k / self.num_experts * self.capacity_factor
            # Rounded first: 100 x 2 / 4 x 1.1 is 55.000000000000007 in floats, and 55 slots exactly.
            capacity = (math.ceil(round(capacity, 9)) if valid is None
                        else torch.ceil(torch.round(capacity, decimals=9)))
            keep = capacity_mask(ids, experts, capacity).view_as(selected)
            if valid is not None:
                keep = keep & valid[:, None]
            dropped = (~keep).sum() if valid is None else (~keep & valid[:, None]).sum()
            expert_ids = torch.where(keep, selected, torch.full_like(selected, -1))
        self.last_dropped = dropped  # a device tensor with capacity dropping: read it only when needed
        if self.training:
            self._record_routing(counts, scores if stat_scores is None else stat_scores, dropped, valid)
        return expert_ids, selected, weights

    # The statistics are kept outside torch.compile's graphs (train.compile compiles routed blocks
    # too): they update Python counters, and whether a forward is a recomputation is known only
    # when it runs.
    @torch.compiler.disable
    @torch.no_grad()
    def _record_routing(self, counts: torch.Tensor, scores: torch.Tensor, dropped,
                        valid: torch.Tensor | None) -> None:
        if recomputing():  # count each training forward once
            return
        if self.bias_update_rate > 0:
            self.pending_counts += counts.to(self.pending_counts.dtype)
        scores = scores.detach().double()
        tokens = scores.shape[0]
        if valid is not None:
            scores, tokens = scores * valid[:, None], valid.sum()
        self.stats.add_forward(counts.double(), scores.sum(0), tokens, tokens * self.top_k)
        if self.capacity_factor > 0:
            self.stats.add("dropped", dropped)
        if self.aux_loss is not None:
            self.stats.add("aux", self.aux_loss.detach())

    @torch.compiler.disable
    @torch.no_grad()
    def record(self, norms: bool = False, **values: torch.Tensor) -> None:
        """Add each value to its statistic (RoutingStats.ON_DEVICE), once per training forward;
        with `norms`, each value's fp32 L2 norm (computed only when it is counted)."""
        if not recomputing():
            for name, value in values.items():
                self.stats.add(name, torch.linalg.vector_norm(value, dtype=torch.float32) if norms else value)

    def may_drop(self) -> bool:
        """Whether route() may drop assignments (capacity dropping, in training only)."""
        return self.capacity_factor > 0 and self.training

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The aux-loss-free bias update. Collective over the data-parallel group; every rank calls
        it after every optimizer step (GPT.after_optimizer_step)."""
        if self.bias_update_rate <= 0:
            return
        counts = self.pending_counts.clone()
        if dist.is_initialized() and ps.model_parallel_is_initialized():
            dist.all_reduce(counts, group=ps.get_data_parallel_group())
        self.router_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.pending_counts.zero_()

    @torch.no_grad()
    def after_skipped_step(self) -> None:
        """A step that was not applied moves the bias neither: its batch's counts are dropped."""
        self.pending_counts.zero_()


def sparse_layers(model: nn.Module) -> list[RoutedLayer]:
    return [m for m in model.modules() if isinstance(m, RoutedLayer)]


def scores_from_norms(sq: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 norms from fp32 sums of squares; eps keeps the gradient finite at zero."""
    return torch.sqrt(sq + eps)


__all__ = ["RoutedLayer", "RoutingStats", "switch_aux_loss", "sparse_layers", "scores_from_norms"]
