"""Building blocks shared by every model: megatron-core parallel linears, RoPE, SwiGLU MLP.

Weights are initialised on the CPU from one full-size master tensor and then split, so a
model built with the same seed holds the same numbers at every tensor-parallel size.
"""

from __future__ import annotations

import functools
import importlib
import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from models.config import ModelConfig


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def parallel_config(params_dtype: torch.dtype = torch.float32) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size(),
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=params_dtype,
        perform_initialization=True,
    )


def normal_init(std: float):
    return partial(nn.init.normal_, mean=0.0, std=std)


def output_init(cfg: ModelConfig):
    # Residual-branch outputs scaled by depth, as in GPT-2 / Megatron.
    return normal_init(cfg.init_std / math.sqrt(2.0 * cfg.num_layers))


def column_linear(cfg: ModelConfig, in_features: int, out_features: int, **kwargs) -> nn.Module:
    """Output features split across TP ranks; the result stays split (gather_output=False)."""
    return tensor_parallel.ColumnParallelLinear(
        in_features,
        out_features,
        config=parallel_config(),
        init_method=kwargs.pop("init_method", normal_init(cfg.init_std)),
        bias=False,
        gather_output=False,
        **kwargs,
    )


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core's, with its own tensor-parallel group handed to the matmul: the stock forward
    passes none, which warns on every call and so splits each torch.compile'd block into pieces."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        matmul = self._forward_impl

        def forward_impl(*args, tp_group=None, **kwargs):
            return matmul(*args, tp_group=self.tp_group if tp_group is None else tp_group, **kwargs)

        self._forward_impl = forward_impl


def row_linear(cfg: ModelConfig, in_features: int, out_features: int) -> nn.Module:
    """Input features split across TP ranks; the output is all-reduced."""
    return RowParallelLinear(
        in_features,
        out_features,
        config=parallel_config(),
        init_method=output_init(cfg),
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )


@functools.cache
def _triton_function(module: str, name: str):
    """A function of one of the Triton kernel modules, or None on a machine without Triton (they
    are imported only where a GPU runs them)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def rope_angles(head_dim: int, start: int, end: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [end - start, head_dim / 2] (float32) of positions start..end-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(start, end, dtype=torch.int64).float(), inv_freq)
    return angles.cos(), angles.sin()


class Rotary(nn.Module):
    """Rotary position embedding (half-split layout, as in Llama). The angles are float32 products, as
    transformers and Meta's Llama code compute them: a model imported from them or exported to them
    gives the same logits at every position (float64 angles drift from theirs with the position)."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float):
        super().__init__()
        cos, sin = rope_angles(head_dim, 0, max_seq_len, base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim] at positions offset..offset+seq-1. Eagerly on a GPU one
        Triton kernel (models/attention/kernels/rotary_triton.py); torch.compile fuses the formula."""
        seq = x.shape[-2]
        if offset + seq > self.cos.shape[0]:
            raise ValueError(f"positions {offset}..{offset + seq - 1} exceed the {self.cos.shape[0]} RoPE was "
                             "built for (model.max_seq_len)")
        if x.is_cuda and not torch.compiler.is_compiling():
            fused = _triton_function("models.attention.kernels.rotary_triton", "rotary")
            if fused is not None:
                return fused(x, self.cos[offset:offset + seq], self.sin[offset:offset + seq])
        cos = self.cos[offset:offset + seq].to(x.dtype)
        sin = self.sin[offset:offset + seq].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gate_and_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved gate/up rows [..., 2w] -> gate, up [..., w]. Unbound, not indexed: indexing each
    half gives each a zero-filled gradient of the whole in backward."""
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return gate, up


def swiglu_kept(fused: bool) -> int:
    """Elements per neuron and token that w_out(swiglu(w_in(x))) keeps for backward: the gate/up
    output (2) and the product (1), and with the formula SiLU's output too, which the fused kernel
    and compiled blocks recompute."""
    return 3 if fused else 4


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of interleaved gate/up rows [..., 2w] -> [..., w]. Eagerly on a GPU one
    Triton kernel (models/mlp/kernels/swiglu_triton.py), which keeps only gate_up for backward;
    torch.compile fuses the formula."""
    if gate_up.is_cuda and not torch.compiler.is_compiling():
        fused = _triton_function("models.mlp.kernels.swiglu_triton", "swiglu")
        if fused is not None:
            return fused(gate_up)
    gate, up = gate_and_up(gate_up)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP. Gate and up rows interleave (gate_0, up_0, gate_1, ...) so that a
    contiguous TP split gives every rank matching gate/up neurons."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        self.hidden = hidden or cfg.ffn_hidden_size
        assert self.hidden % tp_size() == 0, f"MLP width {self.hidden} at TP={tp_size()} (validate_model)"
        self.w_in = column_linear(cfg, cfg.hidden_size, 2 * self.hidden)
        self.w_out = row_linear(cfg, self.hidden, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.w_in(x)
        out, _ = self.w_out(swiglu(gate_up))
        return out


def gather_tensor_parallel(t: torch.Tensor) -> torch.Tensor:
    """Each tensor-parallel rank's share along the last dimension -> the whole, in rank order (the
    column-parallel layout: heads, vocabulary rows); as it is at tensor-parallel size 1. Forward only
    (megatron-core's gather assumes CUDA)."""
    import torch.distributed as dist

    if not dist.is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)
