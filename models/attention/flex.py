"""Softmax attention through FlexAttention (GPU) under a block mask. Within documents, the mask from
the document ids skips every key block that lies outside a query block's documents, where SDPA with
a boolean mask computes all seq^2 scores. The sink kind runs here with or without documents (SDPA
takes its sink logits as a float bias of seq^2 per head, kept for backward: at 4096 positions on an
H200 3.4x the time of flash softmax, where FlexAttention within documents took 1.5x), using the
log-sum-exp FlexAttention returns:

    o_sink = o * sigmoid(lse - b_h)     (exp(lse) / (exp(lse) + exp(b_h)) of the weight stays on keys)

On CPU FlexAttention has no backward, so training there keeps SDPA's masked path; the forward is
what the tests compare.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# FlexAttention's GPU kernels hold a block of queries and keys in shared memory: wider heads (LISA's
# score features without grouped-query attention, 528 at the 1B hybrid width) run out of it, and
# inductor's lowering refuses heads narrower than 16.
FLEX_MAX_HEAD_DIM = 256
FLEX_MIN_HEAD_DIM = 16


def flex_takes(head_dim: int) -> bool:
    """Whether FlexAttention's GPU kernels take heads this wide."""
    return FLEX_MIN_HEAD_DIM <= head_dim <= FLEX_MAX_HEAD_DIM


def flex_runs(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether FlexAttention's GPU kernels run queries q over keys k: on a GPU, over their own keys
    (not decoding after cached ones), heads it takes."""
    return q.is_cuda and q.shape[-2] == k.shape[-2] and flex_takes(q.shape[-1])


def document_block_mask(documents: torch.Tensor | None, q_len: int, k_len: int,
                        device: torch.device | None = None) -> BlockMask:
    """Causal within documents ([batch, seq] ids), shared by every head; without documents causal,
    shared by every sequence too (on `device`, which it then needs)."""
    if documents is None:
        if device is None:
            raise ValueError("a causal block mask needs its device")
        return create_block_mask(_causal, None, None, q_len, k_len, device=device)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    return create_block_mask(same_document_causal, documents.shape[0], None, q_len, k_len,
                             device=documents.device)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@functools.cache
def _compiled():
    # Sequence lengths compile static first and dynamic once they vary (prompts, padded buckets),
    # not a kernel per length up to dynamo's recompile limit and then the unfused seq^2 path.
    return torch.compile(flex_attention, dynamic=None)


def flex_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
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


def block_mask_for(ctx: dict, documents: torch.Tensor | None, seq: int,
                   device: torch.device | None = None) -> BlockMask:
    """One block mask per forward, built by the first layer that needs it (`device`: where a mask
    without documents goes)."""
    mask = ctx.get("flex_block_mask")
    if mask is None:
        mask = ctx["flex_block_mask"] = document_block_mask(documents, seq, seq, device)
    return mask
