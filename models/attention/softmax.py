"""Causal softmax attention through scaled_dot_product_attention (flash kernels on GPU).

When a later LISA layer needs this layer's scores, or attention is captured for metrics, the
scores are materialised ([batch, heads, seq, seq]) and the output comes from the explicit weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.attention.base import ProjectedAttention, expand_kv


def causal_mask(q_len: int, k_len: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Boolean [q_len, k_len]: query i (at absolute position offset + i) sees keys j <= offset + i."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + offset
    return torch.arange(k_len, device=device).unsqueeze(0) <= rows


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Pre-softmax logits q.k / sqrt(head_dim), unmasked: [batch, heads, q_len, k_len]."""
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    mask = causal_mask(scores.shape[-2], scores.shape[-1], scores.device)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def causal_softmax_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Explicit attention weights [batch, heads, q_len, k_len]; for metrics, not training."""
    return causal_softmax(scaled_scores(q, k))


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA; k/v may hold fewer (grouped-query) heads than q."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class SoftmaxAttention(ProjectedAttention):
    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        if not (self.publish_scores or ctx.get("capture_attention")):
            return softmax_attention(q, k, v)
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        scores = scaled_scores(q, k)
        self.publish(ctx, scores)
        weights = causal_softmax(scores)
        self.capture(ctx, weights, normalised=True)
        return weights.to(v.dtype) @ v
