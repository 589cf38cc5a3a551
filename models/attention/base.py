"""Self-attention with Q/K/V projections split by heads across tensor-parallel ranks.

Subclasses supply only the attention core: how queries, keys and values combine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.config import ModelConfig
from models.layers import column_linear, row_linear, tp_size


def check_heads_divisible(cfg: ModelConfig) -> int:
    if cfg.num_heads % tp_size():
        raise ValueError(
            f"model.num_heads={cfg.num_heads} is not divisible by tensor parallel size {tp_size()}"
        )
    return cfg.num_heads // tp_size()


class ProjectedAttention(nn.Module):
    """x -> (q, k, v) per local head -> core -> output projection.

    The fused QKV weight is laid out head-major ([head, q|k|v, head_dim]) so a contiguous
    TP split hands every rank whole heads.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        # Set by build_attention when the next layer is a LISA layer that reuses this one's scores.
        self.publish_scores = False
        self.local_heads = check_heads_divisible(cfg)
        self.head_dim = cfg.head_dim
        self.qkv = column_linear(cfg, cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = row_linear(cfg, cfg.hidden_size, cfg.hidden_size)

    def project(self, x: torch.Tensor, ctx: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        qkv, _ = self.qkv(x)
        qkv = qkv.view(batch, seq, self.local_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv.unbind(0)  # each [batch, heads, seq, head_dim]
        rotary = ctx["rotary"]
        return rotary(q), rotary(k), v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        raise NotImplementedError

    def publish(self, ctx: dict, scores: torch.Tensor) -> None:
        """Hand this layer's pre-activation scores [batch, local_heads, seq, seq] to a following
        LISA layer (only when one needs them)."""
        if self.publish_scores:
            ctx.setdefault("attention_scores", {})[self.layer] = scores

    def capture(self, ctx: dict, weights: torch.Tensor, normalised: bool) -> None:
        """Store the weights applied to the values for metrics, when ctx["capture_attention"] is set.
        normalised=False marks kernels whose rows need not sum to one (ReLU attention)."""
        if ctx.get("capture_attention"):
            ctx.setdefault("attention_maps", {})[self.layer] = weights.detach()
            ctx.setdefault("attention_normalised", {})[self.layer] = normalised

    def forward(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        q, k, v = self.project(x, ctx)
        if ctx.get("recompute_attention"):  # selective activation checkpointing
            o = checkpoint(self.core, q, k, v, ctx, use_reentrant=False)
        else:
            o = self.core(q, k, v, ctx)  # [batch, heads, seq, head_dim]
        o = o.transpose(1, 2).flatten(2)
        out, _ = self.out(o)
        return out
