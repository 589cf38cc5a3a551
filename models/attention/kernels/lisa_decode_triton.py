"""A LISA layer decoding one token as one fused Triton kernel (GPU): the same function as the
PyTorch path of models.attention.lisa (AlignedScores.materialize, then LISAAttention.mix) for a
new query after T cached positions:

    a_h[j] = sum_g M[h, g] S[g, j] + W2[h] . GELU(W1 S[:, j] + b1) + b2[h] + qr_h . kr_h[j]
    o_h    = softmax_j(a_h) V          or   sum_j ReLU(a_h[j]) V[j] / n

(S: the new score row of the layer before, per head of h's alignment group; qr / kr: the rank-r
query and cached keys). The PyTorch path runs about twenty kernels over rows of T scores per head,
among them the FFN's hidden activations (align_hidden times the row); here each program reads its
group's source rows, its rank-r keys and its values once, per block of keys, and keeps everything
else in registers. Programs split the keys across (batch x head x chunk) as flash-decoding does, so a
single sequence still fills the GPU; the chunks' partial sums are merged by their maxima after the
kernel. A program aligns the whole group to get its own head's row (the FFN is a few dozen
operations per key; a decode step is bound by reading the cache). With store_scores the aligned row
is written out for a following LISA layer. Under TRITON_INTERPRET=1 the kernel runs on CPU tensors
(how the tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.triton_launch import accumulator, triton_interpreted


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # exact, as F.gelu


@triton.jit
def _decode(S, QR, KR, V, MIX, W1, B1, W2, B2, PART_O, PART_M, PART_L, A,
            ss_b, ss_h, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sa_b, sa_h,
            H, G, HID, R, DV, SHARE_V, T, CHUNK, SPLITS,
            GP: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
            RELU: tl.constexpr, FFN: tl.constexpr, STORE: tl.constexpr, ACC: tl.constexpr):
    bh, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = bh // H, bh % H
    n, j = h // G, h % G  # alignment group (this rank's), place in it
    gs, hs, rs, ds = tl.arange(0, GP), tl.arange(0, HP), tl.arange(0, RP), tl.arange(0, DP)
    mix = tl.load(MIX + n * G * G + j * G + gs, mask=gs < G, other=0.0).to(ACC)  # row j of M
    if FFN:
        w1 = tl.load(W1 + n * HID * G + hs[:, None] * G + gs[None, :], mask=(hs[:, None] < HID) & (gs[None, :] < G),
                     other=0.0).to(ACC)  # [HP, GP]
        b1 = tl.load(B1 + n * HID + hs, mask=hs < HID, other=0.0).to(ACC)
        w2 = tl.load(W2 + n * G * HID + j * HID + hs, mask=hs < HID, other=0.0).to(ACC)  # row j of W2
        b2 = tl.load(B2 + n * G + j).to(ACC)
    qr = tl.load(QR + b * sq_b + h * sq_h + rs, mask=rs < R, other=0.0).to(ACC)
    source_rows = S + b * ss_b + (n * G + gs[:, None]) * ss_h
    keys = KR + b * sk_b + h * sk_h
    values = V + b * sv_b + (h // SHARE_V) * sv_h
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, T)
    m = tl.full([1], float("-inf"), ACC)
    total = tl.zeros([1], ACC)
    acc = tl.zeros([DP], ACC)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        valid = cols < hi
        s = tl.load(source_rows + cols[None, :], mask=(gs[:, None] < G) & valid[None, :], other=0.0).to(ACC)
        a = tl.sum(mix[:, None] * s, axis=0)  # [BN]
        if FFN:
            hidden = tl.sum(w1[:, :, None] * s[None, :, :], axis=1) + b1[:, None]  # [HP, BN]
            a += tl.sum(w2[:, None] * _gelu(hidden), axis=0) + b2
        kr = tl.load(keys + cols[:, None] * sk_s + rs[None, :], mask=valid[:, None] & (rs[None, :] < R),
                     other=0.0).to(ACC)
        a += tl.sum(kr * qr[None, :], axis=1)
        if STORE:
            tl.store(A + b * sa_b + h * sa_h + cols, a.to(A.dtype.element_ty), mask=valid)
        v = tl.load(values + cols[:, None] * sv_s + ds[None, :], mask=valid[:, None] & (ds[None, :] < DV),
                    other=0.0).to(ACC)
        if RELU:
            p = tl.where(valid, tl.maximum(a, 0.0), 0.0)
        else:
            a = tl.where(valid, a, float("-inf"))
            top = tl.maximum(m, tl.max(a, axis=0))
            shrink = tl.exp(m - top)
            p = tl.exp(a - top)
            total = total * shrink + tl.sum(p, axis=0)
            acc = acc * shrink
            m = top
        acc += tl.sum(p[:, None] * v, axis=0)
    part = bh * SPLITS + split
    tl.store(PART_O + part * DP + ds, acc)
    tl.store(PART_M + part + tl.arange(0, 1), m)
    tl.store(PART_L + part + tl.arange(0, 1), total)


def _key_block() -> int:
    return 16 if triton_interpreted() else 64


def _splits(batch_heads: int, keys: int, block: int) -> int:
    """Key chunks per (batch, head): enough programs to fill a large GPU (about 1k), each chunk at
    least four key blocks."""
    if triton_interpreted():
        return min(3, triton.cdiv(keys, block))  # several chunks even at tiny sizes: the merge is tested
    return max(1, min(triton.cdiv(1024, batch_heads), triton.cdiv(keys, 4 * block)))


def lisa_decode(source: torch.Tensor, qr: torch.Tensor, kr: torch.Tensor, v: torch.Tensor, mix: torch.Tensor,
                ffn: tuple[torch.Tensor, ...] | None, relu_normaliser: torch.Tensor | None,
                store_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """source [batch, heads, 1, T] (the layer before's new score row), qr [batch, heads, 1, rank]
    (scaled by 1 / sqrt(rank)), kr [batch, heads, T, rank], v [batch, kv_heads, T, head_dim]; the
    alignment's mix [groups, g, g] and ffn (w1 [groups, hidden, g], b1 [groups, hidden],
    w2 [groups, g, hidden], b2 [groups, g]) or None for linear head mixing. relu_normaliser: n of
    the new query for ReLU weights, None for softmax. -> (output [batch, heads, 1, head_dim], the
    aligned scores [batch, heads, 1, T] with store_scores, else None)."""
    batch, heads, _, keys = source.shape
    group, dv, rank = mix.shape[-1], v.shape[-1], qr.shape[-1]
    hidden = ffn[0].shape[1] if ffn is not None else 0
    source, kr, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (source, kr, v))
    qr = qr.contiguous()
    acc = torch.float64 if source.dtype == torch.float64 else torch.float32
    block = _key_block()
    splits = _splits(batch * heads, keys, block)
    chunk = triton.cdiv(triton.cdiv(keys, splits), block) * block
    splits = triton.cdiv(keys, chunk)  # no empty chunk
    dp = max(16, triton.next_power_of_2(dv))
    part_o = torch.empty(batch, heads, splits, dp, dtype=acc, device=v.device)
    part_m = torch.empty(batch, heads, splits, dtype=acc, device=v.device)
    part_l = torch.empty_like(part_m)
    scores = torch.empty(batch, heads, 1, keys, dtype=qr.dtype, device=v.device) if store_scores else part_m
    w1, b1, w2, b2 = (t.contiguous() for t in ffn) if ffn is not None else (mix,) * 4  # unused pointers
    _decode[(batch * heads, splits)](
        source, qr, kr, v, mix.contiguous(), w1, b1, w2, b2, part_o, part_m, part_l, scores,
        source.stride(0), source.stride(1), qr.stride(0), qr.stride(1), *kr.stride()[:3], *v.stride()[:3],
        scores.stride(0), scores.stride(1) if store_scores else 0,
        heads, group, hidden, rank, dv, heads // v.shape[1], keys, chunk, splits,
        GP=triton.next_power_of_2(group), HP=max(1, triton.next_power_of_2(hidden)),
        RP=triton.next_power_of_2(rank), DP=dp, BN=block, RELU=relu_normaliser is not None, FFN=ffn is not None,
        STORE=store_scores, ACC=accumulator(acc))
    part_o = part_o[..., :dv]
    if relu_normaliser is not None:
        out = part_o.sum(2) / relu_normaliser.to(acc)
    else:  # merge the chunks' softmax sums by their maxima
        weight = torch.exp(part_m - part_m.amax(-1, keepdim=True))
        out = (weight[..., None] * part_o).sum(2) / (weight * part_l).sum(-1, keepdim=True)
    return out[:, :, None].to(v.dtype), scores if store_scores else None
