"""Self-attention with Q/K/V projections split by heads across tensor-parallel ranks.

Subclasses supply only the attention core: how queries, keys and values combine. With grouped-query
attention (model.num_kv_heads < num_heads) cores get keys and values with the K/V heads only; query
head j reads K/V head j // (num_heads / num_kv_heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.attention.shared_scores import SharedScores, grouped_matmul
from models.config import ModelConfig
from models.layers import column_linear, row_linear, tp_size
from models.registry import ActivationLayout


def local_heads(cfg: ModelConfig) -> int:
    """Query heads per tensor-parallel rank (every rank holds whole K/V groups)."""
    assert cfg.num_heads % cfg.kv_heads == 0 and cfg.kv_heads % tp_size() == 0, \
        f"{cfg.num_heads} heads / {cfg.kv_heads} K/V heads at TP={tp_size()} (models.registry.validate_model)"
    return cfg.num_heads // tp_size()


def projected_params(cfg: ModelConfig) -> int:
    """Parameters of the fused QKV and output projections."""
    return 2 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * cfg.kv_width


def projected_activations(cfg: ModelConfig, layout: ActivationLayout, stores_scores: bool) -> float:
    """Elements per token kept for backward: q, k, v, rotated q and k, the attention output and the
    output projection's input ((4h + 3k) / t, k = K/V width), plus heads x seq / t scores when the
    core keeps them (not under selective checkpointing, which recomputes the core)."""
    h, t = cfg.hidden_size, layout.tensor
    scores = cfg.num_heads * layout.seq / t if stores_scores and not layout.selective else 0.0
    return (4 * h + 3 * cfg.kv_width) / t + scores


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [batch, kv_heads, seq, dim] -> [batch, heads, seq, dim], each K/V head repeated for
    the query heads of its group (a no-op without grouped-query attention)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Pre-activation logits q.k / sqrt(head_dim), unmasked: [batch, heads, q_len, k_len] from
    q [batch, heads, q_len, d] and k [batch, kv_heads, k_len, d]."""
    return grouped_matmul(q / math.sqrt(q.shape[-1]), k.transpose(-2, -1))  # scaled first: no fp16 overflow


class ProjectedAttention(nn.Module):
    """x -> (q, k, v) per local head -> core -> output projection.

    The fused QKV weight is laid out by K/V group ([kv_head, q_1..q_g|k|v, head_dim], g query heads
    per K/V head; [head, q|k|v, head_dim] without grouped-query attention) so a contiguous TP split
    hands every rank whole groups.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        # Set by models.registry.build_attention when the next layer reuses this one's scores.
        self.publish_scores = False
        self.local_heads = local_heads(cfg)
        self.kv_groups = cfg.num_heads // cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.qkv = column_linear(cfg, cfg.hidden_size, cfg.hidden_size + 2 * cfg.kv_width)
        self.out = row_linear(cfg, cfg.hidden_size, cfg.hidden_size)

    def project(self, x: torch.Tensor, ctx: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        qkv, _ = self.qkv(x)
        g = self.kv_groups
        qkv = qkv.view(batch, seq, self.local_heads // g, g + 2, self.head_dim)
        q = qkv[:, :, :, :g].flatten(2, 3).transpose(1, 2)  # [batch, heads, seq, head_dim]
        k, v = (qkv[:, :, :, i].transpose(1, 2) for i in (g, g + 1))  # [batch, kv_heads, seq, head_dim]
        rotary = ctx["rotary"]
        return rotary(q), rotary(k), v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Causal attention of q [batch, heads, q_len, d] over k / v [batch, kv_heads, k_len, d]; q_len <
        k_len when decoding after cached keys (the queries are the last q_len positions)."""
        raise NotImplementedError

    def publish(self, ctx: dict, scores: torch.Tensor | SharedScores) -> None:
        """Hand this layer's pre-activation scores (explicit [batch, local_heads, q_len, k_len], or as
        features) to a following layer that reuses them (LISA), only when one does: GPT passes
        ctx["published_scores"] on as the next layer's ctx["shared_scores"]."""
        if self.publish_scores:
            ctx["published_scores"] = scores

    def publish_projection(self, ctx: dict, q: torch.Tensor, k: torch.Tensor) -> None:
        """Publish q . k / sqrt(head_dim) as features: this layer keeps its fused kernel."""
        if self.publish_scores:
            self.publish(ctx, SharedScores.of_projection(q, k))

    def explicit(self, q: torch.Tensor, k: torch.Tensor, ctx: dict) -> bool:
        """Whether the core builds the explicit scores instead of running a fused kernel: to capture
        the weights, and when decoding one token after cached keys for a following LISA layer, which
        reads the new score row: computed once for both layers, not a fused kernel here and the same
        product over the keys again there (a chunk of several tokens hands over features, whose rows
        the LISA layer builds and frees). On CPU also for one new token in any layer: SDPA's CPU
        kernel reads each K/V head once per query head there (1.5-2x slower with grouped-query heads
        at 1k-4k cached positions)."""
        if ctx.get("capture_attention"):
            return True
        one_token = q.shape[-2] == 1 < k.shape[-2]
        return one_token and (self.publish_scores or q.device.type == "cpu")

    def attend_explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict,
                        weights_of: Callable[[torch.Tensor], torch.Tensor], normalised: bool) -> torch.Tensor:
        """weights_of(scores) @ v from the explicit scores, which are published and captured."""
        scores = scaled_scores(q, k)
        self.publish(ctx, scores)
        weights = weights_of(scores)
        self.capture(ctx, weights, normalised)
        return grouped_matmul(weights.to(v.dtype), v)

    def capture(self, ctx: dict, weights: torch.Tensor, normalised: bool) -> None:
        """Store the weights applied to the values for metrics, when ctx["capture_attention"] is set.
        normalised=False marks kernels whose rows need not sum to one (ReLU attention)."""
        if ctx.get("capture_attention"):
            ctx.setdefault("attention_maps", {})[self.layer] = weights.detach()
            ctx.setdefault("attention_normalised", {})[self.layer] = normalised

    def forward(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        q, k, v = self.project(x, ctx)
        if ctx.get("kv_cache") is not None:  # decoding: the keys and values of earlier positions too
            k, v = ctx["kv_cache"].extend(self.layer, k, v)
        if ctx.get("recompute_attention"):  # selective activation checkpointing
            o = checkpoint(self.core, q, k, v, ctx, use_reentrant=False)
        else:
            o = self.core(q, k, v, ctx)  # [batch, heads, seq, head_dim]
        o = o.transpose(1, 2).flatten(2)
        out, _ = self.out(o)
        return out
