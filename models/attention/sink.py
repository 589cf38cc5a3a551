"""Softmax attention with a learnable per-head sink logit b_h in the denominator (as in gpt-oss):

    p_ij = exp(s_ij) / (exp(b_h) + sum_{j' <= i} exp(s_ij'))

so a head can put weight "nowhere" instead of on the first token. On GPU FlexAttention runs it within
documents and, in training, without (models.attention.flex; no seq^2 tensors); elsewhere SDPA with
extra all-zero key/value columns, the first with additive bias b_h.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from torch import nn

from models.attention.base import ProjectedAttention, projected_activations, projected_params
from models.attention.flex import block_mask_for, flex_masked_attention, flex_runs, flex_takes
from models.attention.masks import visible
from models.config import ModelConfig
from models.registry import AttentionKind, register_attention


def sink_softmax_weights(scores: torch.Tensor, sink: torch.Tensor, documents: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Weights on the real keys [batch, heads, q, k] from unmasked scores and sink logits [heads];
    each row sums to 1 - (weight on the sink)."""
    b, h, sq, sk = scores.shape
    mask = visible(sq, sk, scores.device, documents)
    sink_col = sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    logits = torch.cat([sink_col, scores.masked_fill(~mask, float("-inf"))], dim=-1)
    return logits.softmax(-1)[..., 1:]


def sink_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sink: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with sink logits [heads], via SDPA and extra zero key/value columns: the
    first carries the sink logit as its bias, the rest (padding the key length to a multiple of 8
    for fused kernels' mask alignment) are masked out. k/v may hold fewer (grouped-query) heads."""
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    extra = 1 + (-(sk + 1)) % 8
    zeros = q.new_zeros(b, k.shape[1], extra, d)
    k = torch.cat([zeros, k], dim=2)
    v = torch.cat([zeros.to(v.dtype), v], dim=2)
    mask = visible(sq, sk, q.device, documents)  # [sq, sk], or [b, 1, sq, sk] within documents
    rows = mask.shape[0] if mask.dim() == 4 else 1
    causal = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    pad = torch.full((rows, h, sq, extra - 1), float("-inf"), dtype=q.dtype, device=q.device)
    bias = torch.cat([sink.to(q.dtype).view(1, h, 1, 1).expand(rows, h, sq, 1), pad,
                      causal.expand(rows, h, sq, sk)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=k.shape[1] != h)


def flex_runs_sink(q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None) -> bool:
    """Whether FlexAttention runs the sink kind: where it runs these queries and keys, within
    documents or in training (where SDPA would keep its seq^2 bias for backward; inference over
    whole sequences takes SDPA, which compiles nothing per prompt)."""
    return flex_runs(q, k) and (documents is not None or torch.is_grad_enabled())


class SinkSoftmaxAttention(ProjectedAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        # Full-size init then this rank's heads: the same numbers at every tensor-parallel size.
        full = torch.empty(cfg.num_heads).normal_(0.0, cfg.init_std)
        rank = ps.get_tensor_model_parallel_rank()
        self.sink = nn.Parameter(full[rank * self.local_heads:(rank + 1) * self.local_heads].clone())
        set_tensor_model_parallel_attributes(self.sink, True, 0, 1)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        documents = ctx.get("document_ids")
        if self.explicit(q, k, ctx):  # publishes the scores without the sink logit, which is not shared
            weights_of = partial(sink_softmax_weights, sink=self.sink, documents=documents)
            return self.attend_explicit(q, k, v, ctx, weights_of, normalised=False)
        self.publish_projection(ctx, q, k)
        if flex_runs_sink(q, k, documents):
            mask = block_mask_for(ctx, documents, q.shape[-2], q.device)
            return flex_masked_attention(q, k, v, mask, sink=self.sink)
        return sink_softmax_attention(q, k, v, self.sink, documents)


register_attention(AttentionKind(
    name="softmax_sink", letter="k", module=SinkSoftmaxAttention,
    params=lambda cfg: projected_params(cfg) + cfg.num_heads,  # + one sink logit per head
    # FlexAttention (bf16 on GPU, as softmax's flash kernels) keeps no scores; SDPA keeps the bias.
    activations=lambda cfg, layout: projected_activations(
        cfg, layout, stores_scores=not (layout.flash and flex_takes(cfg.head_dim))),
    score_family="softmax",  # a LISA layer after it applies plain softmax (the sink logit is not shared)
    hf_remote=True, sections=(),
))
