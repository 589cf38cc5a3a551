"""Causal ReLU attention without row normalisation:

    o_i = sum_{j <= i} ReLU(q_i . k_j / sqrt(d)) v_j / n_i,
    n_i in {1, i + 1 (visible keys), max(i, 1) (visible keys after the first), seq_len}  (i from 0)

(model.relu_attention.normalizer = none | prefix | content | seqlen; content leaves out the
first key, the BOS of a sample that starts with one; within documents, prefix and content count
the keys of query i's own document). Rows of the weights need not sum to
one, so a head can output ~0 without parking weight on a sink token. Queries are processed in
blocks of model.relu_attention.block_size in forward and backward (the backward recomputes the
block's scores), so memory is O(block x seq) per head rather than O(seq^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from models.attention.base import ProjectedAttention, expand_kv, projected_activations, projected_params
from models.attention.masks import keys_seen, visible
from models.attention.shared_scores import grouped_matmul
from models.config import ConfigError, ModelConfig
from models import registry
from models.registry import AttentionKind, ParallelSizes, register_attention, register_section

NORMALIZERS = ("none", "prefix", "content", "seqlen")


KERNELS = ("auto", "torch")


@dataclass
class ReLUAttentionConfig:
    normalizer: str = "prefix"  # none | prefix | content | seqlen
    block_size: int = 128  # query block for O(block x seq) memory (the PyTorch path); 256 is slower on CPU
    # auto: the fused Triton kernels on a GPU where they apply (models.attention.kernels.relu_triton),
    # else the PyTorch path; torch: always the PyTorch path.
    kernel: str = "auto"


register_section("relu_attention", ReLUAttentionConfig, training_only=("block_size", "kernel"))


def reuses_relu_scores(cfg: ModelConfig) -> bool:
    """Whether a layer that reuses scores (LISA) reads a relu-family layer's (a plug-in kind's too), so
    applies ReLU weights with model.relu_attention.normalizer."""
    kinds = cfg.attention_kinds()
    sources = {registry.score_source(kinds, layer) for layer, kind in enumerate(kinds)
               if registry.attention_kind(kind).reads_previous_scores}
    return any(source and registry.attention_kind(source).score_family == "relu" for source in sources)


def reads_row_length(cfg: ModelConfig) -> bool:
    """Whether outputs depend on the length of the row (the seqlen normaliser divides by it): on the
    padding, so on what else shares a batch, and on every token a decoded sequence adds. Relu layers
    apply it, and so do layers reusing a relu-family layer's scores."""
    return cfg.relu_attention.normalizer == "seqlen" and (
        "relu" in cfg.attention_kinds() or reuses_relu_scores(cfg))


def fused_kernel(q: torch.Tensor, v: torch.Tensor):
    """The Triton ReLU attention function when it runs for these inputs, else None."""
    if not q.is_cuda:  # the kernels' module imports Triton: only where they can run
        return None
    try:
        from models.attention.kernels.relu_triton import supports, triton_relu_attention
    except ImportError:  # no Triton on this machine
        return None
    return triton_relu_attention if supports(q, v) else None


def relu_normaliser(normalizer: str, q_len: int, seq_len: int, device, offset: int = 0,
                    documents: torch.Tensor | None = None) -> torch.Tensor:
    """n_i for queries offset..offset+q_len-1: [q_len, 1] float, or [batch, 1, q_len, 1] for prefix
    within documents, where it counts the keys of the query's own document. seqlen stays the sample
    length: the length of a document would tell every position where its document ends."""
    if normalizer == "none":
        return torch.ones(q_len, 1, device=device)
    if normalizer in ("prefix", "content"):  # number of keys query i sees (1-based position)
        if documents is not None:
            seen = keys_seen(documents, q_len, offset)
        else:
            seen = torch.arange(offset + 1, offset + q_len + 1, device=device, dtype=torch.float32)[:, None]
        return seen if normalizer == "prefix" else (seen - 1).clamp(min=1)
    if normalizer == "seqlen":
        return torch.full((q_len, 1), float(seq_len), device=device)
    raise ValueError(f"model.relu_attention.normalizer={normalizer!r}: choose one of {NORMALIZERS}")


def relu_weights(scores: torch.Tensor, normalizer: str, documents: torch.Tensor | None = None,
                 seq_len: int | None = None) -> torch.Tensor:
    """Absolute weights ReLU(s_ij) / n_i on visible keys from unmasked scores [.., q, k]; the
    queries are the last q of k positions, in a sample of seq_len (default k) positions."""
    sq, sk = scores.shape[-2:]
    mask = visible(sq, sk, scores.device, documents)
    n = relu_normaliser(normalizer, sq, seq_len or sk, scores.device, sk - sq, documents).to(scores.dtype)
    return scores.relu().masked_fill(~mask, 0.0) / n


class _BlockedReLUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, normalizer: str, block: int, documents, scale: float):
        seq = q.shape[-2]
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device)
        for start in range(0, seq, block):
            end = min(start + block, seq)
            scores = (q[..., start:end, :] @ k[..., :end, :].transpose(-2, -1)) * scale
            mask = visible(end - start, end, q.device, documents, offset=start)
            n = relu_normaliser(normalizer, end - start, seq, q.device, start, documents).to(scores.dtype)
            weights = scores.relu().masked_fill(~mask, 0.0) / n
            out[..., start:end, :] = weights.to(v.dtype) @ v[..., :end, :]
        ctx.save_for_backward(q, k, v)
        ctx.normalizer, ctx.block, ctx.documents, ctx.scale = normalizer, block, documents, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        seq, scale = q.shape[-2], ctx.scale
        grad_out = grad_out.contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate low precision in fp32
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k, dtype=acc)
        dv = torch.zeros_like(v, dtype=acc)
        for start in range(0, seq, ctx.block):
            end = min(start + ctx.block, seq)
            q_blk, g = q[..., start:end, :], grad_out[..., start:end, :]
            k_pre, v_pre = k[..., :end, :], v[..., :end, :]
            scores = (q_blk @ k_pre.transpose(-2, -1)) * scale
            mask = visible(end - start, end, q.device, ctx.documents, offset=start)
            n = relu_normaliser(ctx.normalizer, end - start, seq, q.device, start, ctx.documents).to(scores.dtype)
            active = (scores > 0) & mask
            weights = scores.masked_fill(~active, 0.0) / n
            dv[..., :end, :] += (weights.transpose(-2, -1) @ g.to(weights.dtype)).to(acc)
            d_weights = g @ v_pre.transpose(-2, -1).to(g.dtype)
            d_scores = d_weights.masked_fill(~active, 0.0).to(scores.dtype) / n * scale
            dq[..., start:end, :] = (d_scores @ k_pre).to(acc)
            dk[..., :end, :] += (d_scores.transpose(-2, -1) @ q_blk).to(acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def relu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, normalizer: str = "prefix",
                   block: int = 256, documents: torch.Tensor | None = None, scale: float | None = None
                   ) -> torch.Tensor:
    """Blocked causal ReLU attention on [batch, heads, seq, head_dim] (within documents when given);
    scores q . k * scale, scale defaulting to 1 / sqrt(head_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _BlockedReLUAttention.apply(q, k, v, normalizer, max(1, int(block)), documents, scale)


def relu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: ReLUAttentionConfig,
                documents: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal ReLU attention by model.relu_attention: the fused kernel where it runs, else the
    blocked PyTorch path; k/v may hold fewer (grouped-query) heads; scale defaults to 1 / sqrt(q's width)."""
    if q.shape[-2] != k.shape[-2]:  # decoding after cached keys: a few query rows, explicit weights
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = grouped_matmul(q * scale, k.transpose(-2, -1))  # scaled first, as scaled_scores
        return grouped_matmul(relu_weights(scores, settings.normalizer, documents).to(v.dtype), v)
    fused = fused_kernel(q, v) if settings.kernel == "auto" else None
    if fused is not None:  # grouped K/V heads go in as they are
        return fused(q, k, v, settings.normalizer, scale, documents)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    return relu_attention(q, k, v, settings.normalizer, settings.block_size, documents, scale)


class ReLUAttention(ProjectedAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.settings = cfg.relu_attention

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        documents = ctx.get("document_ids")
        if self.explicit(q, k, ctx):  # pre-activation scores published
            weights_of = partial(relu_weights, normalizer=self.settings.normalizer, documents=documents,
                                 seq_len=ctx.get("row_length"))  # a metric's probe: the training length
            return self.attend_explicit(q, k, v, ctx, weights_of, normalised=False)
        self.publish_projection(ctx, q, k)
        return relu_attend(q, k, v, self.settings, documents)


def validate(cfg: ModelConfig, kinds: list[str], sizes: ParallelSizes) -> None:
    relu = cfg.relu_attention
    if relu.normalizer not in NORMALIZERS:
        raise ConfigError(f"model.relu_attention.normalizer={relu.normalizer!r}: choose one of {NORMALIZERS}")
    if relu.block_size < 1:
        raise ConfigError(f"model.relu_attention.block_size={relu.block_size} must be >= 1")
    if relu.kernel not in KERNELS:
        raise ConfigError(f"model.relu_attention.kernel={relu.kernel!r}: choose one of {KERNELS}")


register_attention(AttentionKind(
    name="relu", letter="r", module=ReLUAttention, params=projected_params,
    activations=lambda cfg, layout: projected_activations(cfg, layout, stores_scores=True),
    score_family="relu", validate=validate, hf_remote=True, sections=("relu_attention",),
))
