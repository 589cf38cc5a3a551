"""Softmax attention within documents through FlexAttention (GPU): a block mask from the document
ids skips every key block that lies outside a query block's documents, where SDPA with a boolean
mask computes all seq^2 scores. The sink kind uses the log-sum-exp FlexAttention returns:

    o_sink = o * sigmoid(lse - b_h)     (exp(lse) / (exp(lse) + exp(b_h)) of the weight stays on keys)

On CPU FlexAttention has no backward, so training there keeps SDPA's masked path; the forward is
what the tests compare.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_block_mask(documents: torch.Tensor, q_len: int, k_len: int) -> BlockMask:
    """Causal within documents ([batch, seq] ids), shared by every head."""

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    return create_block_mask(same_document_causal, documents.shape[0], None, q_len, k_len,
                             device=documents.device)


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                            sink: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of q [batch, heads, seq, d] over k / v (grouped-query heads allowed) under the
    block mask; with `sink` [heads] the sink logits share each row's denominator."""
    attend = _compiled() if q.is_cuda else flex_attention  # compiled kernels on GPU, the reference on CPU
    gqa = k.shape[1] != q.shape[1]
    if sink is None:
        return attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, lse = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    acc = torch.promote_types(out.dtype, torch.float32)  # bf16 activations: the sigmoid in fp32
    keep = torch.sigmoid(lse.to(acc) - sink.to(acc).view(1, -1, 1)).to(out.dtype)
    return out * keep.unsqueeze(-1)


def block_mask_for(ctx: dict, documents: torch.Tensor, seq: int) -> BlockMask:
    """One block mask per forward, built by the first layer that needs it."""
    mask = ctx.get("flex_block_mask")
    if mask is None:
        mask = ctx["flex_block_mask"] = document_block_mask(documents, seq, seq)
    return mask
