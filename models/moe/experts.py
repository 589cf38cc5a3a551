"""Routed experts in a DeepSpeed MoE container, with megatron-core's expert groups.

DeepSpeed treats parameters as experts only inside a `deepspeed.moe.layer.MoE` module: the engine
then reduces their gradients over the expert-data-parallel group (dividing by the full
data-parallel size), builds MoE-aware ZeRO-1/2 optimizer groups, and saves each expert in its
own `layer_{L}_expert_{E}_mp_rank_XX_model_states.pt` file keyed by the global expert id.
`ExpertContainer` subclasses that MoE class but replaces its gate and GShard dispatch with the
caller's routing and the dropless all-to-all in `models.moe.dispatch`.

Process groups have one source of truth, megatron-core's parallel_state: when the engine asks the
container to set up its groups, megatron-core's expert-model-parallel and expert-data-parallel
groups are registered in DeepSpeed under the name `ep_size_{EP}`, instead of DeepSpeed creating
its own. A differing pre-existing DeepSpeed group of that name is an error.

Expert tensor parallelism follows megatron-core's default (expert TP size = TP size): each expert's
D_e neurons are split across the tensor-parallel ranks like a dense SwiGLU (interleaved gate/up
rows), every TP rank routes the same tokens, and the partial outputs are summed over TP by the
caller. The expert-parallel group is then made of ranks with the same TP rank.
"""

from __future__ import annotations

import os
from functools import partial

import torch

# DeepSpeed picks its accelerator when first imported (which the kind registry may do while a config
# is read): without a GPU it must be the CPU one, and unless told so it says so on stdout.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.moe.experts import Experts  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from torch import nn  # noqa: E402

from models.config import ModelConfig
from models.layers import output_init, swiglu, tp_size
from models.moe.dispatch import dispatch_combine
from models.moe.routing import GroupedGemm, grouped_gemm_mode


def ep_world() -> int:
    return ps.get_expert_model_parallel_world_size()


def ep_rank() -> int:
    return ps.get_expert_model_parallel_rank()


def group_name(ep: int) -> str:
    return f"ep_size_{ep}"


def register_deepspeed_expert_groups() -> str:
    """Make DeepSpeed's expert / expert-data groups megatron-core's. Idempotent; returns the name."""
    from deepspeed.utils import groups

    ep = ep_world()
    name = group_name(ep)
    pairs = (
        (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ps.get_expert_model_parallel_group()),
        (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
         ps.get_expert_data_parallel_group()),
    )
    for registry, ranks_registry, group in pairs:
        ranks = dist.get_process_group_ranks(group)
        if name in registry:
            existing = dist.get_process_group_ranks(registry[name])
            if existing != ranks:
                raise RuntimeError(f"DeepSpeed group {name} has ranks {existing} but megatron-core's has {ranks}")
            continue
        registry[name] = group
        ranks_registry[name] = ranks
    return name


class ExpertMLP(nn.Module):
    """One SwiGLU expert of width D_e, split over tensor-parallel ranks (gate/up rows interleaved).

    `forward` returns this rank's partial output; the caller sums it over TP."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        local = width // tp_size()
        self.w_in = nn.Parameter(torch.empty(2 * local, hidden))
        self.w_out = nn.Parameter(torch.empty(hidden, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(swiglu(F.linear(x, self.w_in)), self.w_out)


@torch.library.custom_op("uoe_pretrain::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """y = x W_e^T on each expert e's rows of x [T, in] (expert-major; offsets: their cumulative
    ends, int32) with weights W_e [out, in], as one grouped GEMM over the weights stacked for the
    call. Backward stacks them again instead of keeping the stack (kept, the stacks of all routed
    layers held the local experts' weights once more: 1.6 GB for the 1B UoE on an H200). Custom ops,
    so that torch.compile does not keep the stack either."""
    return torch._grouped_mm(x, _stacked(weights, x.dtype).transpose(-2, -1), offs=offsets)


@grouped_linear.register_fake
def _(x, offsets, weights):
    return x.new_empty(x.shape[0], weights[0].shape[0])


@torch.library.custom_op("uoe_pretrain::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                            weights: list[torch.Tensor], input_grad: bool,
                            weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of x or an empty tensor, the weights' gradients [L, out, in] or an empty tensor).
    The weights' is one GEMM grouped over the rows; an expert without rows gets zeros."""
    grad = grad.contiguous()  # row- or column-major for torch._grouped_mm (a sum's grad is neither)
    grad_x, grad_w = grad.new_empty(0), grad.new_empty(0)
    if input_grad:
        grad_x = torch._grouped_mm(grad, _stacked(weights, grad.dtype), offs=offsets)
    if weight_grad:
        rows = torch.diff(offsets, prepend=offsets.new_zeros(1))
        grad_w = torch._grouped_mm(grad.transpose(0, 1), x, offs=offsets)
        grad_w.masked_fill_(rows.view(-1, 1, 1) == 0, 0)
    return grad_x, grad_w


@grouped_linear_backward.register_fake
def _(grad, x, offsets, weights, input_grad, weight_grad):
    return (grad.new_empty(x.shape if input_grad else (0,)),
            grad.new_empty((len(weights), *weights[0].shape) if weight_grad else (0,)))


def _save_for_grouped_linear(ctx, inputs, output):
    x, offsets, weights = inputs
    ctx.save_for_backward(x, offsets, *weights)
    ctx.input_grad, ctx.weight_grad = x.requires_grad, any(w.requires_grad for w in weights)


def _grouped_linear_grads(ctx, grad):
    x, offsets, *weights = ctx.saved_tensors
    grad_x, grad_w = grouped_linear_backward(grad, x, offsets, weights, ctx.input_grad, ctx.weight_grad)
    grad_ws = ([g.to(w.dtype) for g, w in zip(grad_w.unbind(0), weights)] if ctx.weight_grad
               else [None] * len(weights))
    return grad_x if ctx.input_grad else None, None, grad_ws


grouped_linear.register_autograd(_grouped_linear_grads, setup_context=_save_for_grouped_linear)


def _stacked(weights, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack(weights).to(dtype)  # [L, out, in]


def grouped_swiglu(experts, inputs: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
    """All local SwiGLU experts in two grouped GEMMs (torch._grouped_mm) over expert-major rows,
    instead of one small GEMM pair per expert. DeepSpeed keeps one module per expert, so each GEMM
    stacks their weights for the call (grouped_linear).
    rows_per_expert: [L] on the inputs' device, so that nothing waits for the device."""
    if not inputs.shape[0]:  # stay in the autograd graph: the backward all-to-all needs every rank
        return experts[0](inputs)
    offsets = rows_per_expert.cumsum(0).to(torch.int32)
    hidden = swiglu(grouped_linear(inputs, offsets, [e.w_in for e in experts]))
    return grouped_linear(hidden, offsets, [e.w_out for e in experts])


def grouped_gemm_here(cfg: ModelConfig, local_width: int) -> GroupedGemm:
    """models.moe.routing.grouped_gemm_mode on this machine's GPU."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return grouped_gemm_mode(cfg.moe.grouped_gemm, capability, cfg.hidden_size, local_width)


_dispatch_eagerly = torch.compiler.disable(dispatch_combine)


class _Dispatcher(nn.Module):
    """Stands where DeepSpeed's MOELayer stands (`deepspeed_moe`): holds `experts`."""

    def __init__(self, experts: Experts, num_experts: int, grouped_gemm: GroupedGemm = GroupedGemm()):
        super().__init__()
        self.experts = experts
        self.num_experts = num_experts
        self.grouped_gemm = grouped_gemm
        self.ep_group = None
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, group) -> None:
        self.ep_group = _SINGLE if dist.get_world_size(group) == 1 else group

    def forward(self, x, expert_ids, weights, may_drop: bool = True):
        group = self.ep_group
        if group is _SINGLE:
            group = None
        elif group is None:
            group = ps.get_expert_model_parallel_group()
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        local = self.experts.deepspeed_experts
        grouped = self.grouped_gemm.runs(bf16=x.dtype == torch.bfloat16)
        run_local = partial(grouped_swiglu, local) if grouped else None
        # Without host syncs (dropless, experts local and grouped: torch._grouped_mm's fused kernel
        # on Hopper, or a CPU) torch.compile traces the dispatch with the rest of the block;
        # otherwise it runs eagerly between compiled parts.
        traceable = group is None and run_local is not None and not may_drop
        dispatch = dispatch_combine if traceable else _dispatch_eagerly
        return dispatch(x, expert_ids, weights, local, self.num_experts, group, run_local, may_drop)


class ExpertContainer(MoE):
    """The N routed SwiGLU experts of one layer (this rank's N / EP of them), as a DeepSpeed MoE.

    forward(x [T, d], expert_ids [T, K], weights [T, K], may_drop) -> this TP rank's partial [T, d]
    (may_drop: whether expert_ids may hold -1, dropped assignments).
    Parameter keys follow DeepSpeed: `deepspeed_moe.experts.deepspeed_experts.{local}.w_in|w_out`.
    """

    def __init__(self, cfg: ModelConfig, num_experts: int, width: int, ep_size: int | None = None):
        nn.Module.__init__(self)  # MoE.__init__ would build a TopKGate whose weight stays unused
        ep = ep_world() if ep_size is None else ep_size
        assert num_experts % ep == 0 and width % tp_size() == 0, \
            f"{num_experts} experts of width {width} at EP={ep}, TP={tp_size()} (models.registry.validate_model)"
        if ps.get_expert_tensor_parallel_world_size() != tp_size():
            raise ValueError("experts are split over the tensor-parallel group: megatron-core's expert tensor "
                             "parallel size must equal the tensor parallel size (its default)")
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep
        self.expert_group_name = group_name(ep)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.width = width
        experts = Experts(ExpertMLP(cfg.hidden_size, width), self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = _Dispatcher(experts, num_experts, grouped_gemm_here(cfg, width // tp_size()))
        if ep == 1:
            self.deepspeed_moe.ep_group = _SINGLE
        self._init_weights(cfg, ep_rank() if ep > 1 else 0)
        for name, param in self.named_parameters():
            if tp_size() > 1:  # really split over TP: DeepSpeed must count it on every TP rank
                param.tensor_model_parallel = True
                param.partition_dim = 0 if name.endswith("w_in") else 1  # rows of w_in, columns of w_out

    @torch.no_grad()
    def _init_weights(self, cfg: ModelConfig, rank: int) -> None:
        """All N experts are drawn from the global RNG at full width, then this rank keeps its
        slice: the same seed gives the same experts at every EP and TP size."""
        d, n, width = cfg.hidden_size, self.num_experts, self.width
        w_in = torch.empty(n, 2 * width, d)
        nn.init.normal_(w_in, mean=0.0, std=cfg.init_std)
        w_out = torch.empty(n, d, width)
        output_init(cfg)(w_out)
        tp, tp_rank = tp_size(), ps.get_tensor_model_parallel_rank()
        local = width // tp
        for i, expert in enumerate(self.deepspeed_moe.experts.deepspeed_experts):
            g = rank * self.num_local_experts + i
            expert.w_in.copy_(w_in[g, 2 * local * tp_rank: 2 * local * (tp_rank + 1)])
            expert.w_out.copy_(w_out[g, :, local * tp_rank: local * (tp_rank + 1)])

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel is not supported; megatron-core defines the groups")
        if self.ep_size != ep_world():
            raise RuntimeError(f"layer built for expert-parallel size {self.ep_size}, megatron-core has {ep_world()}")
        register_deepspeed_expert_groups()
        self.deepspeed_moe._set_ep_group(ps.get_expert_model_parallel_group())

    def forward(self, x, expert_ids, weights, may_drop: bool = True):  # noqa: D102 (differs from MoE's)
        return self.deepspeed_moe(x, expert_ids, weights, may_drop)


class _Single:
    """Marker: all experts local, no communication (ep_size=1 forced by the caller)."""


_SINGLE = _Single()
