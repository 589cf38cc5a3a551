"""Causal ReLU attention as fused Triton kernels (GPU): the same function as
models.attention.relu.relu_attention:

    o_i = sum_{j <= i} ReLU(q_i . k_j / sqrt(d)) v_j / n_i     (n_i: model.relu_attention.normalizer)

Blockwise like flash attention, but with no online softmax: a query block's output is a plain sum
over key blocks, divided by n_i at the end. Forward keeps nothing but q, k, v; backward recomputes
the scores, once per key block for dK/dV (over every query head of its K/V group: grouped-query
attention is native, no K/V repeat) and once per query block for dQ. Within documents
(data.document_mask) a query sees the keys from its document's start on, and prefix / content count
those keys; documents are contiguous, so their start and end positions are all the kernels read,
and they skip the key blocks before a query block's first document (and, for dK/dV, the query
blocks after a key block's last one). Queries and keys may be wider than the values (LISA
attends over score features of width head_dim + rank or more): the kernels run at the next power
of two and mask the columns beyond the real width, which leaves every score as it is (no padded
copies). Under TRITON_INTERPRET=1 the kernels run on CPU tensors
(how the tests check them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from models.attention.kernels.triton_dot import dot as _dot
from models.attention.masks import document_bounds
from models.triton_launch import triton_interpreted

NORMALIZER_CODES = {"none": 0, "prefix": 1, "content": 2, "seqlen": 3}


MAX_QK_WIDTH = 256  # after padding to a power of two


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels run for these inputs: on the GPU in 16/32-bit floats (their fp32
    accumulators take no fp64 products: Triton refuses to compile them) or under the interpreter, a
    value width that is a power of two from 16 to 128, queries and keys at most MAX_QK_WIDTH wide
    once padded."""
    dv = v.shape[-1]
    on_device = (q.is_cuda and q.dtype != torch.float64) or triton_interpreted()
    return on_device and 16 <= dv <= 128 and dv & (dv - 1) == 0 and _padded(q.shape[-1]) <= MAX_QK_WIDTH


def _padded(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


@triton.jit
def _normaliser(rows, first, seq_len, NORM: tl.constexpr):
    """n_i of queries `rows` whose documents start at `first` (0 without documents)."""
    pos = (rows - first).to(tl.float32)
    if NORM == 0:
        n = pos * 0.0 + 1.0
    elif NORM == 1:
        n = pos + 1.0
    elif NORM == 2:
        n = tl.maximum(pos, 1.0)
    else:
        n = pos * 0.0 + seq_len
    return n


@triton.jit
def _key_block(q, K, V, k_offset, v_offset, sk_s, sv_s, start, S, W, scale, IEEE: tl.constexpr, BN: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr):
    """Keys start..start+BN of one K/V head: (their positions, K, V, the scaled scores q.k)."""
    cols = start + tl.arange(0, BN)
    kdims = tl.arange(0, DK)
    k = tl.load(K + k_offset + cols[:, None] * sk_s + kdims[None, :], mask=(cols[:, None] < S) & (kdims[None, :] < W),
                other=0.0)
    v = tl.load(V + v_offset + cols[:, None] * sv_s + tl.arange(0, DV)[None, :], mask=cols[:, None] < S, other=0.0)
    return cols, k, v, _dot(q, tl.trans(k), IEEE) * scale


@triton.jit
def _starts(STARTS, b, rows, S, DOCS: tl.constexpr):
    """Where each query's document starts (0 without documents)."""
    if DOCS:
        first = tl.load(STARTS + b * S + rows, mask=rows < S, other=0)
    else:
        first = rows * 0
    return first


@triton.jit
def _document_starts(STARTS, b, rows, S, BN: tl.constexpr, DOCS: tl.constexpr):
    """(where each query's document starts, the first key block any of them sees)."""
    first = _starts(STARTS, b, rows, S, DOCS)
    if DOCS:
        lo = tl.min(tl.where(rows < S, first, S), axis=0) // BN * BN
    else:
        lo = 0
    return first, lo


@triton.jit
def _forward(Q, K, V, O, STARTS, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s, H, GROUP,
             S, W, scale, seq_len, NORM: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, DOCS: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets for large tensors
    b, h = bh // H, bh % H
    kvh = h // GROUP
    rows = block * BM + tl.arange(0, BM)
    first, lo = _document_starts(STARTS, b, rows, S, BN, DOCS)
    kdims = tl.arange(0, DK)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + kdims[None, :],
                mask=(rows[:, None] < S) & (kdims[None, :] < W), other=0.0)
    acc = tl.zeros([BM, DV], dtype=tl.float32)
    for start in range(lo, tl.minimum((block + 1) * BM, S), BN):
        cols, k, v, s = _key_block(q, K, V, b * sk_b + kvh * sk_h, b * sv_b + kvh * sv_h, sk_s, sv_s, start, S,
                                   W, scale, IEEE, BN, DK, DV)
        keep = (cols[None, :] <= rows[:, None]) & (cols[None, :] < S) & (cols[None, :] >= first[:, None])
        w = tl.where(keep, tl.maximum(s, 0.0), 0.0)
        acc += _dot(w.to(v.dtype), v, IEEE)
    acc = acc / _normaliser(rows, first, seq_len, NORM)[:, None]
    tl.store(O + b * so_b + h * so_h + rows[:, None] * so_s + tl.arange(0, DV)[None, :],
             acc.to(O.dtype.element_ty), mask=rows[:, None] < S)


@triton.jit
def _backward_kv(Q, K, V, DO, DK_, DV_, STARTS, ENDS, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b,
                 so_h, so_s, H, GROUP, S, W, scale, seq_len, NORM: tl.constexpr, IEEE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DOCS: tl.constexpr):
    """dK, dV of one key block of one K/V head, summed over the query heads of its group (dK is laid
    out like K, dV like V, dO like the output)."""
    block, bkv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    kv_heads = H // GROUP
    b, kvh = bkv // kv_heads, bkv % kv_heads
    cols = block * BN + tl.arange(0, BN)
    kdims, vdims = tl.arange(0, DK), tl.arange(0, DV)
    ko = b * sk_b + kvh * sk_h + cols[:, None] * sk_s + kdims[None, :]
    vo = b * sv_b + kvh * sv_h + cols[:, None] * sv_s + vdims[None, :]
    k_mask = (cols[:, None] < S) & (kdims[None, :] < W)
    k = tl.load(K + ko, mask=k_mask, other=0.0)
    v = tl.load(V + vo, mask=cols[:, None] < S, other=0.0)
    dk = tl.zeros([BN, DK], dtype=tl.float32)
    dv = tl.zeros([BN, DV], dtype=tl.float32)
    if DOCS:  # no query after the block's last document sees it
        hi = tl.max(tl.load(ENDS + b * S + cols, mask=cols < S, other=0), axis=0)
    else:
        hi = S
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        for start in range(block * BN, hi, BM):  # only queries at or after the block's first key
            rows = start + tl.arange(0, BM)
            first = _starts(STARTS, b, rows, S, DOCS)
            q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + kdims[None, :],
                        mask=(rows[:, None] < S) & (kdims[None, :] < W), other=0.0)
            do = tl.load(DO + b * so_b + h * so_h + rows[:, None] * so_s + vdims[None, :], mask=rows[:, None] < S,
                         other=0.0)
            n = _normaliser(rows, first, seq_len, NORM)[:, None]
            s = _dot(q, tl.trans(k), IEEE) * scale
            active = ((cols[None, :] <= rows[:, None]) & (rows[:, None] < S) & (cols[None, :] < S) & (s > 0)
                      & (cols[None, :] >= first[:, None]))
            w = tl.where(active, s, 0.0) / n
            dv += _dot(tl.trans(w).to(do.dtype), do, IEEE)
            ds = tl.where(active, _dot(do, tl.trans(v), IEEE) / n, 0.0) * scale
            dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE)
    tl.store(DK_ + ko, dk.to(DK_.dtype.element_ty), mask=k_mask)
    tl.store(DV_ + vo, dv.to(DV_.dtype.element_ty), mask=cols[:, None] < S)


@triton.jit
def _backward_q(Q, K, V, DO, DQ, STARTS, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s, H,
                GROUP, S, W, scale, seq_len, NORM: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DOCS: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    rows = block * BM + tl.arange(0, BM)
    first, lo = _document_starts(STARTS, b, rows, S, BN, DOCS)
    kdims = tl.arange(0, DK)
    qo = b * sq_b + h * sq_h + rows[:, None] * sq_s + kdims[None, :]
    q_mask = (rows[:, None] < S) & (kdims[None, :] < W)
    q = tl.load(Q + qo, mask=q_mask, other=0.0)
    do = tl.load(DO + b * so_b + h * so_h + rows[:, None] * so_s + tl.arange(0, DV)[None, :],
                 mask=rows[:, None] < S, other=0.0)
    n = _normaliser(rows, first, seq_len, NORM)[:, None]
    dq = tl.zeros([BM, DK], dtype=tl.float32)
    for start in range(lo, tl.minimum((block + 1) * BM, S), BN):
        cols, k, v, s = _key_block(q, K, V, b * sk_b + kvh * sk_h, b * sv_b + kvh * sv_h, sk_s, sv_s, start, S,
                                   W, scale, IEEE, BN, DK, DV)
        active = (cols[None, :] <= rows[:, None]) & (cols[None, :] < S) & (s > 0) & (cols[None, :] >= first[:, None])
        ds = tl.where(active, _dot(do, tl.trans(v), IEEE) / n, 0.0) * scale
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + qo, dq.to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(width: int) -> tuple[int, int]:
    """(query block, key block) for the wider of the query/key and value widths."""
    if triton_interpreted():
        return 16, 16
    return (64, 64) if width <= 64 else (64, 32) if width <= 128 else (32, 32)


class _TritonReLUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, normalizer: str, scale: float, starts, ends):
        q, k, v = (t.contiguous() for t in (q, k, v))
        batch, heads, seq, width = q.shape
        dk, dv = _padded(width), v.shape[-1]
        group = heads // k.shape[1]
        bm, bn = _blocks(max(dk, dv))
        docs = starts is not None
        if not docs:  # unused pointers
            starts = ends = q
        out = torch.empty(batch, heads, seq, dv, dtype=v.dtype, device=v.device)
        _forward[(triton.cdiv(seq, bm), batch * heads)](
            q, k, v, out, starts, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], heads,
            group, seq, width, scale, float(seq), NORM=NORMALIZER_CODES[normalizer], IEEE=q.dtype == torch.float32,
            BM=bm, BN=bn, DK=dk, DV=dv, DOCS=docs)
        ctx.save_for_backward(q, k, v, starts, ends)
        ctx.normalizer, ctx.scale, ctx.docs = normalizer, scale, docs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, starts, ends = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        batch, heads, seq, width = q.shape
        kv_heads, dk, dv = k.shape[1], _padded(width), v.shape[-1]
        bm, bn = _blocks(max(dk, dv))
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3])
        args = (heads, heads // kv_heads, seq, width, ctx.scale, float(seq))
        meta = dict(NORM=NORMALIZER_CODES[ctx.normalizer], IEEE=q.dtype == torch.float32, BM=bm, BN=bn, DK=dk,
                    DV=dv, DOCS=ctx.docs)
        dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _backward_kv[(triton.cdiv(seq, bn), batch * kv_heads)](
            q, k, v, grad_out, dk_, dv_, starts, ends, *strides, *args, **meta)
        _backward_q[(triton.cdiv(seq, bm), batch * heads)](q, k, v, grad_out, dq, starts, *strides, *args, **meta)
        return dq, dk_, dv_, None, None, None, None


# Run as it is inside torch.compile'd blocks (train.compile): a graph break, as for the other kernels.
@torch.compiler.disable
def triton_relu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, normalizer: str,
                          scale: float | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """q [batch, heads, seq, d_qk], k [batch, kv_heads, seq, d_qk], v [batch, kv_heads, seq, d_v]
    (kv_heads dividing heads); scores q . k * scale, scale defaulting to 1 / sqrt(d_qk); within
    `documents` ([batch, seq] ids, models.attention.masks.document_ids) when given."""
    if normalizer not in NORMALIZER_CODES:
        raise ValueError(f"normalizer={normalizer!r}: choose one of {', '.join(NORMALIZER_CODES)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    starts = ends = None
    if documents is not None:
        starts, ends = (t.to(torch.int32).contiguous() for t in document_bounds(documents))
    return _TritonReLUAttention.apply(q, k, v, normalizer, scale, starts, ends)
