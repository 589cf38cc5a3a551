"""Causal softmax attention through scaled_dot_product_attention (flash kernels on GPU). With
document masking: FlexAttention with a block mask on GPU (models.attention.flex), a boolean
block-causal mask for SDPA's memory-efficient kernels on CPU.

A later LISA layer gets this layer's scores as q/k features (models.attention.shared_scores), so
the fused kernels stay; when attention is captured for metrics, and for the new rows a following
LISA layer reads at decode, the scores are materialised ([batch, heads, q_len, k_len]) and the
output comes from the explicit weights (ProjectedAttention.explicit).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.attention.base import ProjectedAttention, projected_activations, projected_params
from models.attention.flex import block_mask_for, flex_masked_attention, flex_runs
from models.attention.masks import visible
from models.config import ModelConfig
from models.registry import AttentionKind, LlamaMapping, register_attention


def causal_softmax(scores: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    mask = visible(scores.shape[-2], scores.shape[-1], scores.device, documents)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


# cuDNN's SDPA builds an execution graph per sequence length, so decoding, whose keys grow by one
# each step, would build one per token (the likely cause of 41 ms per token for a three-layer softmax
# model on an H200, against 4 ms with two of its layers LISA). One new query goes to the kernels that
# take any length.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      documents: torch.Tensor | None = None, scale: float | None = None,
                      block_mask=None) -> torch.Tensor:
    """Causal SDPA; k/v may hold fewer (grouped-query) heads than q; scale defaults to
    1 / sqrt(head_dim). Within documents: FlexAttention on GPU when `block_mask` (a function giving
    the forward's block mask) is passed and it takes these queries and keys (flex_runs), else a
    boolean mask, which the memory-efficient kernels take."""
    gqa = k.shape[1] != q.shape[1]
    if documents is None and q.shape[-2] == 1:  # one new query sees every cached key: no mask
        with sdpa_kernel(DECODE_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if documents is None and q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if documents is not None and block_mask is not None and flex_runs(q, k):
        return flex_masked_attention(q, k, v, block_mask(), scale=scale)
    mask = visible(q.shape[-2], k.shape[-2], q.device, documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class SoftmaxAttention(ProjectedAttention):
    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        documents = ctx.get("document_ids")
        if self.explicit(q, k, ctx):
            return self.attend_explicit(q, k, v, ctx, partial(causal_softmax, documents=documents), normalised=True)
        self.publish_projection(ctx, q, k)
        flex_mask = partial(block_mask_for, ctx, documents, q.shape[-2])
        return softmax_attention(q, k, v, documents, block_mask=flex_mask)


def to_llama(cfg: ModelConfig, state: dict, src: str, dst: str) -> dict:
    """The fused QKV rows, grouped by K/V head [kv_head, q_1..q_g|k|v, head_dim], as q/k/v_proj (no
    RoPE permutation: both use the half-split rotate_half layout)."""
    h, kv, hd, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    g = h // kv
    qkv = state[src + "qkv.weight"].view(kv, g + 2, hd, d)
    return {dst + "q_proj.weight": qkv[:, :g].reshape(h * hd, d),
            dst + "k_proj.weight": qkv[:, g].reshape(kv * hd, d),
            dst + "v_proj.weight": qkv[:, g + 1].reshape(kv * hd, d),
            dst + "o_proj.weight": state[src + "out.weight"]}


def from_llama(cfg: ModelConfig, state: dict, src: str, dst: str) -> dict:
    """Query head j reads K/V head j // (heads / kv_heads) in both (transformers' repeat_kv), so each
    K/V head's query rows go into its group of the fused QKV weight."""
    h, kv, hd, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    q = state[src + "q_proj.weight"].view(kv, h // kv, hd, d)
    k, v = (state[src + f"{n}_proj.weight"].view(kv, 1, hd, d) for n in "kv")
    return {dst + "qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, d),
            dst + "out.weight": state[src + "o_proj.weight"]}


register_attention(AttentionKind(
    name="softmax", letter="s", module=SoftmaxAttention, params=projected_params,
    # Flash kernels (bf16 on GPU) keep no scores.
    activations=lambda cfg, layout: projected_activations(cfg, layout, stores_scores=not layout.flash),
    score_family="softmax", llama=LlamaMapping(to_llama, from_llama), hf_remote=True, sections=(),
))
