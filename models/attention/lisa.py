"""LISA layer: share the previous layer's attention scores instead of computing full Q/K.

For the H scores S^{l-1}[:, :, i, j] of the previous layer (pre-activation logits, read from
ctx["attention_scores"][layer - 1]) a tiny head-alignment FFN, applied pointwise over the head
axis within groups of `model.lisa.align_group` heads, gives new per-head scores:

    S_hat = M S + W2 GELU(W1 S + b1) + b2          (M: g x g, identity at init; W2, b2: zero at init)

(model.lisa.align_hidden = 0 keeps only the linear head mixing M S, the cheap variant)

and a low-rank per-head correction with RoPE adds the layer-wise difference:

    S = S_hat + (X Wq_r)(X Wk_r)^T / sqrt(r)        (rank r per head; Wk_r zero at init)

V (with its K/V heads under grouped-query attention) and the output projection are kept. The
attention function follows the nearest earlier non-LISA layer: ReLU (same normaliser) after a
relu layer, plain softmax after softmax or softmax_sink layers (the sink logit is not shared). Q/K parameters shrink by head_dim / r
(8x at the default rank). Groups never straddle tensor-parallel ranks, so the group must divide
the local heads (num_heads / parallel.tensor).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.attention.base import ProjectedAttention, check_heads_divisible, expand_kv
from models.attention.relu import relu_weights
from models.attention.softmax import causal_softmax
from models.config import ModelConfig
from models.layers import Rotary, column_linear, row_linear


def lisa_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(rank per head, alignment group, alignment hidden width)."""
    return cfg.lisa.resolved_rank(cfg.head_dim), cfg.lisa.resolved_group(cfg.num_heads), cfg.lisa.align_hidden


def lisa_align_params(cfg: ModelConfig) -> int:
    _, g, hid = lisa_sizes(cfg)
    return cfg.num_heads // g * (g * g + (2 * g * hid + hid + g if hid else 0))


def lisa_param_count(cfg: ModelConfig) -> int:
    """Parameters of one LISA layer (exact for LISAAttention)."""
    d = cfg.hidden_size
    rank, _, _ = lisa_sizes(cfg)
    return 2 * cfg.num_heads * rank * d + d * cfg.kv_width + d * d + lisa_align_params(cfg)


def qk_compression(cfg: ModelConfig) -> float:
    """Full attention's Q/K parameters divided by a LISA layer's (head_dim / rank without
    grouped-query attention)."""
    rank, _, _ = lisa_sizes(cfg)
    return (cfg.hidden_size + cfg.kv_width) / (2 * cfg.num_heads * rank)


def _split_param(full: torch.Tensor, local: int) -> nn.Parameter:
    rank = ps.get_tensor_model_parallel_rank()
    param = nn.Parameter(full[rank * local:(rank + 1) * local].clone())
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


class HeadAlign(nn.Module):
    """Pointwise FFN over the head axis, one per group of g heads (this rank's groups only)."""

    ROW_BLOCK = 256

    def __init__(self, num_heads: int, local_heads: int, group: int, hidden: int):
        super().__init__()
        if local_heads % group:
            raise ValueError(
                f"model.lisa.align_group={group} must divide the heads per tensor-parallel rank "
                f"({local_heads}); alignment groups cannot straddle ranks"
            )
        self.group = group
        groups, local = num_heads // group, local_heads // group
        # Full-size init then this rank's groups: the same model at every tensor-parallel size.
        self.mix = _split_param(torch.eye(group).expand(groups, group, group).clone(), local)
        self.hidden = hidden
        if not hidden:  # align_hidden = 0: linear head mixing only
            return
        self.w1 = _split_param(torch.randn(groups, hidden, group) / math.sqrt(group), local)
        self.b1 = _split_param(torch.zeros(groups, hidden), local)
        self.w2 = _split_param(torch.zeros(groups, group, hidden), local)
        self.b2 = _split_param(torch.zeros(groups, group), local)

    def nonlinear(self, s: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = (p.to(s.dtype) for p in (self.w1, self.b1, self.w2, self.b2))
        hidden = F.gelu(torch.einsum("bnijg,nkg->bnijk", s, w1) + b1[:, None, None, :])
        return torch.einsum("bnijk,ngk->bnijg", hidden, w2) + b2[:, None, None, :]

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [batch, local_heads, q, k] -> same shape, heads mixed within groups.

        The FFN's hidden layer is align_hidden times the size of the scores, so it runs in blocks
        of ROW_BLOCK query rows and, when gradients are on, is recomputed in backward (only the
        scores are kept)."""
        b, h, sq, sk = scores.shape
        s = scores.reshape(b, h // self.group, self.group, sq, sk).permute(0, 1, 3, 4, 2)
        out = torch.einsum("bnijg,nhg->bnijh", s, self.mix.to(s.dtype))
        if not self.hidden:
            return out.permute(0, 1, 4, 2, 3).reshape(b, h, sq, sk)
        parts = []
        for start in range(0, sq, self.ROW_BLOCK):
            rows = s[:, :, start:start + self.ROW_BLOCK]
            if torch.is_grad_enabled():
                parts.append(checkpoint(self.nonlinear, rows, use_reentrant=False))
            else:
                parts.append(self.nonlinear(rows))
        out = out + torch.cat(parts, dim=2)
        return out.permute(0, 1, 4, 2, 3).reshape(b, h, sq, sk)


class LISAAttention(nn.Module):
    publish = ProjectedAttention.publish
    capture = ProjectedAttention.capture

    def __init__(self, cfg: ModelConfig, layer: int, source_kind: str = "softmax"):
        super().__init__()
        self.layer = layer
        self.publish_scores = False
        self.local_heads = check_heads_divisible(cfg)
        self.head_dim = cfg.head_dim
        self.rank, group, hidden = lisa_sizes(cfg)
        self.source_kind = source_kind
        self.normalizer = cfg.relu_attention.normalizer
        d = cfg.hidden_size
        self.qk = column_linear(cfg, d, 2 * cfg.num_heads * self.rank)  # head-major [head, q|k, rank]
        with torch.no_grad():  # zero correction at init: the layer starts as pure (aligned) sharing
            self.qk.weight.view(self.local_heads, 2, self.rank, d)[:, 1].zero_()
        self.v = column_linear(cfg, d, cfg.kv_width)
        self.out = row_linear(cfg, d, d)
        self.align = HeadAlign(cfg.num_heads, self.local_heads, group, hidden)
        self.rotary = Rotary(self.rank, cfg.max_seq_len, cfg.rope_base)

    def scores(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        shared = ctx.get("attention_scores", {}).get(self.layer - 1)
        if shared is None:
            raise RuntimeError(
                f"LISA layer {self.layer} found no attention scores from layer {self.layer - 1}; "
                "was that layer built with publish_scores (build_attention does this)?"
            )
        b, s, _ = x.shape
        qk, _ = self.qk(x)
        q, k = qk.view(b, s, self.local_heads, 2, self.rank).permute(3, 0, 2, 1, 4).unbind(0)
        delta = (self.rotary(q) @ self.rotary(k).transpose(-2, -1)) / math.sqrt(self.rank)
        return self.align(shared.to(delta.dtype)) + delta

    def mix(self, scores: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Attention weights from the scores, applied to the values: [batch, heads, seq, head_dim]."""
        if self.source_kind == "relu":
            weights, normalised = relu_weights(scores, self.normalizer), False
        else:
            weights, normalised = causal_softmax(scores), True
        self.capture(ctx, weights, normalised=normalised)
        return weights.to(v.dtype) @ expand_kv(v, scores.shape[1])

    def forward(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        b, s, _ = x.shape
        scores = self.scores(x, ctx)
        self.publish(ctx, scores)
        v, _ = self.v(x)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        if ctx.get("recompute_attention"):  # selective activation checkpointing
            o = checkpoint(self.mix, scores, v, ctx, use_reentrant=False)
        else:
            o = self.mix(scores, v, ctx)
        out, _ = self.out(o.transpose(1, 2).flatten(2))
        return out
