"""Causal softmax attention through scaled_dot_product_attention (flash kernels on GPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.attention.base import ProjectedAttention


def causal_softmax_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Explicit attention weights [batch, heads, q_len, k_len]; for metrics, not training."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


class SoftmaxAttention(ProjectedAttention):
    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        if ctx.get("capture_attention"):
            ctx.setdefault("attention_maps", {})[self.layer] = causal_softmax_weights(q, k).detach()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
