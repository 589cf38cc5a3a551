"""LISA attention in one pass over key blocks, forward and backward (GPU), as flash attention
builds its weights: each tile of a LISA layer's scores is built where it is used and never written.

For a query block and one alignment group of g <= 4 heads, a tile of keys gives

    S0[h] = qs[h] . ks[h // share]^T                        the source layer's scores (its features)
    S_t[h] = align_t(S_{t-1})[h] + q_t[h] . k_t[h]^T          t = 1..depth (depth 2: a LISA chain)
    align(S)[h] = sum_j M[h, j] S[j] + W2[h] . GELU(W1 S + b1) + b2[h]       (models.attention.lisa)

and the tile of S_depth goes into an online softmax (softmax sources) or ReLU(S) / n_i (relu
sources) and its product with the values, as in flash attention. Forward keeps the output and,
for softmax, each row's log-sum-exp. Backward recomputes the tiles per query block, for the
queries' gradients (source and low-rank) and, in a second pass, the alignment weights' (skipped
where none needs a gradient); and per key block, for the keys' and, in a second pass, the values'
(apart, as each pair would not fit in registers together, except with one head per group). The
alignment's weight gradients are sums over every score; each program adds its tiles' sums to its
own slot (no contention) and those slots are added up after the kernel. A group's heads are
separate tiles (up to four, the unused ones never computed) and the alignment mixes them with
scalar weights, so no tile changes layout. Linear alignment within one K/V head comes as groups of
one head on mixed queries (models.attention.lisa). Under TRITON_INTERPRET=1 the kernels run on CPU
tensors (how the tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.attention.kernels import LISA_FLASH_MAX_GROUP, LISA_FLASH_MAX_WIDTH
from models.attention.kernels.lisa_align_triton import _gelu_and_slope
from models.attention.kernels.relu_triton import NORMALIZER_CODES, _document_starts, _normaliser, _starts
from models.attention.kernels.triton_dot import dot as _dot
from models.attention.masks import document_bounds
from models.triton_launch import accumulator, triton_interpreted

SOFTMAX = -1  # the NORM code of softmax sources; relu sources use relu_triton.NORMALIZER_CODES


def _padded(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def supports(source_width: int, rank: int, value_width: int, group: int, dtype: torch.dtype) -> bool:
    """Whether the kernels take these sizes and type: on a GPU 16-bit floats (in float32 the exact
    products run on ordinary cores and spill tens of KB per thread), any float under the
    interpreter."""
    if not (dtype in (torch.bfloat16, torch.float16) or triton_interpreted()):
        return False
    widest = max(_padded(source_width), _padded(rank), _padded(value_width))
    return group <= LISA_FLASH_MAX_GROUP and widest <= LISA_FLASH_MAX_WIDTH


@triton.jit
def _slot(X, base, stride, idx, S, width, J: tl.constexpr, G: tl.constexpr, WP: tl.constexpr):
    """Rows idx of slot J's head, [len(idx), WP], zero past S and width; zeros for unused slots."""
    dims = tl.arange(0, WP)
    if J < G:
        out = tl.load(X + base + idx[:, None] * stride + dims[None, :],
                      mask=(idx[:, None] < S) & (dims[None, :] < width), other=0.0)
    else:
        out = tl.zeros([idx.shape[0], WP], dtype=X.dtype.element_ty)
    return out


@triton.jit
def _tile(A, a_base, a_stride, a_idx, B, b_base, b_stride, b_idx, S, width, J: tl.constexpr, G: tl.constexpr,
          WP: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    """Slot J's rows a_idx of A times its rows b_idx of B, transposed; zeros for unused slots. Each
    tile loads its operands where it is used, so that few stay live in registers."""
    if J < G:
        a = _slot(A, a_base, a_stride, a_idx, S, width, J, G, WP)
        b = _slot(B, b_base, b_stride, b_idx, S, width, J, G, WP)
        out = _dot(a, tl.trans(b), IEEE).to(ACC)
    else:
        out = tl.zeros([a_idx.shape[0], b_idx.shape[0]], dtype=ACC)
    return out


@triton.jit
def _grad_tile(acc, g, B, b_base, b_stride, b_idx, S, width, J: tl.constexpr, G: tl.constexpr,
               WP: tl.constexpr, IEEE: tl.constexpr):
    """acc + g @ (slot J's rows b_idx of B) for used slots (g cast to B's type, as flash attention
    does)."""
    if J < G:
        b = _slot(B, b_base, b_stride, b_idx, S, width, J, G, WP)
        acc += _dot(g.to(b.dtype), b, IEEE).to(acc.dtype)
    return acc


@triton.jit
def _wsum(W, stride, t0, t1, t2, t3, G: tl.constexpr, ACC: tl.constexpr):
    """sum_j W[j * stride] t_j over the group's G tiles."""
    out = tl.load(W).to(ACC) * t0
    if G > 1:
        out += tl.load(W + stride).to(ACC) * t1
    if G > 2:
        out += tl.load(W + 2 * stride).to(ACC) * t2
    if G > 3:
        out += tl.load(W + 3 * stride).to(ACC) * t3
    return out


@triton.jit
def _align(t0, t1, t2, t3, MIX, W1, B1, W2, B2, G: tl.constexpr, HID: tl.constexpr, ACC: tl.constexpr):
    """align(S) of one group's tiles t (MIX..B2: this group's weights at this stage)."""
    o0 = _wsum(MIX, 1, t0, t1, t2, t3, G, ACC)
    o1, o2, o3 = t1, t2, t3
    if G > 1:
        o1 = _wsum(MIX + G, 1, t0, t1, t2, t3, G, ACC)
    if G > 2:
        o2 = _wsum(MIX + 2 * G, 1, t0, t1, t2, t3, G, ACC)
    if G > 3:
        o3 = _wsum(MIX + 3 * G, 1, t0, t1, t2, t3, G, ACC)
    if HID > 0:
        o0 += tl.load(B2).to(ACC)
        if G > 1:
            o1 += tl.load(B2 + 1).to(ACC)
        if G > 2:
            o2 += tl.load(B2 + 2).to(ACC)
        if G > 3:
            o3 += tl.load(B2 + 3).to(ACC)
        for u in range(HID):
            pre = tl.load(B1 + u).to(ACC) + _wsum(W1 + u * G, 1, t0, t1, t2, t3, G, ACC)
            hidden, _ = _gelu_and_slope(pre)
            o0 += tl.load(W2 + u).to(ACC) * hidden
            if G > 1:
                o1 += tl.load(W2 + HID + u).to(ACC) * hidden
            if G > 2:
                o2 += tl.load(W2 + 2 * HID + u).to(ACC) * hidden
            if G > 3:
                o3 += tl.load(W2 + 3 * HID + u).to(ACC) * hidden
    return o0, o1, o2, o3


@triton.jit
def _total(x):
    return tl.sum(tl.sum(x, axis=1), axis=0)


@triton.jit
def _add_sums(P, stride, x, t0, t1, t2, t3, G: tl.constexpr):
    """P[j * stride] += sum(x * t_j) over the group's tiles (P: this program's own slots, so the adds
    need no ordering)."""
    tl.atomic_add(P, _total(x * t0), sem="relaxed")
    if G > 1:
        tl.atomic_add(P + stride, _total(x * t1), sem="relaxed")
    if G > 2:
        tl.atomic_add(P + 2 * stride, _total(x * t2), sem="relaxed")
    if G > 3:
        tl.atomic_add(P + 3 * stride, _total(x * t3), sem="relaxed")


@triton.jit
def _align_backward(t0, t1, t2, t3, d0, d1, d2, d3, MIX, W1, B1, W2, PART, G: tl.constexpr, HID: tl.constexpr,
                    WEIGHTS: tl.constexpr, ACC: tl.constexpr):
    """The gradient of align's input tiles t from that of its output d; with WEIGHTS, the sums that
    make the weights' gradients added to PART ([M | W1 | b1 | W2 | b2] of this group and stage)."""
    e0 = _wsum(MIX, G, d0, d1, d2, d3, G, ACC)
    e1, e2, e3 = d1, d2, d3
    if G > 1:
        e1 = _wsum(MIX + 1, G, d0, d1, d2, d3, G, ACC)
    if G > 2:
        e2 = _wsum(MIX + 2, G, d0, d1, d2, d3, G, ACC)
    if G > 3:
        e3 = _wsum(MIX + 3, G, d0, d1, d2, d3, G, ACC)
    if WEIGHTS:  # dM[h, j] = sum d_h t_j
        _add_sums(PART, 1, d0, t0, t1, t2, t3, G)
        if G > 1:
            _add_sums(PART + G, 1, d1, t0, t1, t2, t3, G)
        if G > 2:
            _add_sums(PART + 2 * G, 1, d2, t0, t1, t2, t3, G)
        if G > 3:
            _add_sums(PART + 3 * G, 1, d3, t0, t1, t2, t3, G)
    if HID > 0:
        DW1 = PART + G * G
        DB1 = DW1 + HID * G
        DW2 = DB1 + HID
        DB2 = DW2 + G * HID
        for u in range(HID):
            pre = tl.load(B1 + u).to(ACC) + _wsum(W1 + u * G, 1, t0, t1, t2, t3, G, ACC)
            hidden, slope = _gelu_and_slope(pre)
            dpre = slope * _wsum(W2 + u, HID, d0, d1, d2, d3, G, ACC)  # before the GELU
            e0 += tl.load(W1 + u * G).to(ACC) * dpre
            if G > 1:
                e1 += tl.load(W1 + u * G + 1).to(ACC) * dpre
            if G > 2:
                e2 += tl.load(W1 + u * G + 2).to(ACC) * dpre
            if G > 3:
                e3 += tl.load(W1 + u * G + 3).to(ACC) * dpre
            if WEIGHTS:
                _add_sums(DW2 + u, HID, hidden, d0, d1, d2, d3, G)  # dW2[h, u] = sum d_h hidden
                _add_sums(DW1 + u * G, 1, dpre, t0, t1, t2, t3, G)  # dW1[u, j] = sum dpre t_j
                tl.atomic_add(DB1 + u, _total(dpre), sem="relaxed")
        if WEIGHTS:
            tl.atomic_add(DB2, _total(d0), sem="relaxed")
            if G > 1:
                tl.atomic_add(DB2 + 1, _total(d1), sem="relaxed")
            if G > 2:
                tl.atomic_add(DB2 + 2, _total(d2), sem="relaxed")
            if G > 3:
                tl.atomic_add(DB2 + 3, _total(d3), sem="relaxed")
    return e0, e1, e2, e3


@triton.jit
def _stage(MIX, W1, B1, W2, B2, t, n, NG, G: tl.constexpr, HID: tl.constexpr):
    """Pointers to group n's alignment weights at stage t (stacked [depth, groups, ...])."""
    i = t * NG + n
    return MIX + i * G * G, W1 + i * HID * G, B1 + i * HID, W2 + i * G * HID, B2 + i * G


@triton.jit
def _shared_heads(base, h, SHARE, stride_h):
    """Where slot j's key or value head starts (query head h + j reads head (h + j) // SHARE)."""
    return (base + h // SHARE * stride_h, base + (h + 1) // SHARE * stride_h,
            base + (h + 2) // SHARE * stride_h, base + (h + 3) // SHARE * stride_h)


@triton.jit
def _group_tiles(QS, KS, QA, KA, QB, KB, MIX, W1, B1, W2, B2, qo, ko0, ko1, ko2, ko3, ro, sqs_h, sqs_s, sks_s,
                 sr_h, sr_s, rows, cols, S, D, R, n, NG, G: tl.constexpr, HID: tl.constexpr,
                 DEPTH: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, DP: tl.constexpr,
                 RP: tl.constexpr):
    """One group's tiles of queries `rows` over keys `cols`: (the source's scores, the first stage's,
    the last stage's). qo, ro: the group's first head in the source queries and the low-rank
    features; ko0..ko3: each slot's head in the source keys."""
    s0 = _tile(QS, qo, sqs_s, rows, KS, ko0, sks_s, cols, S, D, 0, G, DP, IEEE, ACC)
    s1 = _tile(QS, qo + sqs_h, sqs_s, rows, KS, ko1, sks_s, cols, S, D, 1, G, DP, IEEE, ACC)
    s2 = _tile(QS, qo + 2 * sqs_h, sqs_s, rows, KS, ko2, sks_s, cols, S, D, 2, G, DP, IEEE, ACC)
    s3 = _tile(QS, qo + 3 * sqs_h, sqs_s, rows, KS, ko3, sks_s, cols, S, D, 3, G, DP, IEEE, ACC)
    # the low-rank products before the alignment: fewer spills for sm_90 than after it (bench.kernel_compile)
    a0 = _tile(QA, ro, sr_s, rows, KA, ro, sr_s, cols, S, R, 0, G, RP, IEEE, ACC)
    a1 = _tile(QA, ro + sr_h, sr_s, rows, KA, ro + sr_h, sr_s, cols, S, R, 1, G, RP, IEEE, ACC)
    a2 = _tile(QA, ro + 2 * sr_h, sr_s, rows, KA, ro + 2 * sr_h, sr_s, cols, S, R, 2, G, RP, IEEE, ACC)
    a3 = _tile(QA, ro + 3 * sr_h, sr_s, rows, KA, ro + 3 * sr_h, sr_s, cols, S, R, 3, G, RP, IEEE, ACC)
    GB: tl.constexpr = G * (DEPTH - 1)  # slots of the second stage's low-rank features
    c0 = _tile(QB, ro, sr_s, rows, KB, ro, sr_s, cols, S, R, 0, GB, RP, IEEE, ACC)
    c1 = _tile(QB, ro + sr_h, sr_s, rows, KB, ro + sr_h, sr_s, cols, S, R, 1, GB, RP, IEEE, ACC)
    c2 = _tile(QB, ro + 2 * sr_h, sr_s, rows, KB, ro + 2 * sr_h, sr_s, cols, S, R, 2, GB, RP, IEEE, ACC)
    c3 = _tile(QB, ro + 3 * sr_h, sr_s, rows, KB, ro + 3 * sr_h, sr_s, cols, S, R, 3, GB, RP, IEEE, ACC)
    m, w1, b1, w2, b2 = _stage(MIX, W1, B1, W2, B2, 0, n, NG, G, HID)
    x0, x1, x2, x3 = _align(s0, s1, s2, s3, m, w1, b1, w2, b2, G, HID, ACC)
    x0, x1, x2, x3 = x0 + a0, x1 + a1, x2 + a2, x3 + a3
    f0, f1, f2, f3 = x0, x1, x2, x3
    if DEPTH == 2:
        m, w1, b1, w2, b2 = _stage(MIX, W1, B1, W2, B2, 1, n, NG, G, HID)
        f0, f1, f2, f3 = _align(x0, x1, x2, x3, m, w1, b1, w2, b2, G, HID, ACC)
        f0, f1, f2, f3 = f0 + c0, f1 + c1, f2 + c2, f3 + c3
    return s0, s1, s2, s3, x0, x1, x2, x3, f0, f1, f2, f3


@triton.jit
def _accumulate(s, keep, V, v_base, sv_s, cols, S, DV, acc, m, total, J: tl.constexpr, G: tl.constexpr,
                NORM: tl.constexpr, IEEE: tl.constexpr, VP: tl.constexpr):
    """One key tile of head J: the online softmax (m: row maxima, total: row sums) or ReLU."""
    if J < G:
        v = _slot(V, v_base, sv_s, cols, S, DV, J, G, VP)
        if NORM == -1:
            s = tl.where(keep, s, float("-inf"))
            top = tl.maximum(m, tl.max(s, axis=1))
            safe = tl.where(top == float("-inf"), 0.0, top)  # rows with no visible key yet
            p = tl.exp(s - safe[:, None])
            scale = tl.exp(m - safe)
            total = total * scale + tl.sum(p, axis=1)
            acc = acc * scale[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m = top
        else:
            acc += _dot(tl.where(keep, tl.maximum(s, 0.0), 0.0).to(v.dtype), v, IEEE)
    return acc, m, total


@triton.jit
def _finish(O, LSE, o_base, lse_base, so_s, rows, acc, m, total, norm, S, DV, J: tl.constexpr,
            G: tl.constexpr, NORM: tl.constexpr, VP: tl.constexpr):
    """Store head J's output rows (and, for softmax, their log-sum-exp)."""
    if J < G:
        if NORM == -1:
            acc = acc / total[:, None]
            tl.store(LSE + lse_base + rows, m + tl.log(total), mask=rows < S)
        else:
            acc = acc / norm[:, None]
        dims = tl.arange(0, VP)
        tl.store(O + o_base + rows[:, None] * so_s + dims[None, :], acc.to(O.dtype.element_ty),
                 mask=(rows[:, None] < S) & (dims[None, :] < DV))


@triton.jit
def _keep(rows, cols, first, S):
    causal = (cols[None, :] <= rows[:, None]) & (cols[None, :] < S) & (rows[:, None] < S)
    return causal & (cols[None, :] >= first[:, None])


@triton.jit
def _forward(QS, KS, QA, KA, QB, KB, V, MIX, W1, B1, W2, B2, O, LSE, STARTS, sqs_b, sqs_h, sqs_s, sks_b,
             sks_h, sks_s, sr_b, sr_h, sr_s, sv_b, sv_h, sv_s, so_b, so_h, so_s, H, NG, S, D, R, DV, SHARE_K,
             SHARE_V, seq_len, G: tl.constexpr, HID: tl.constexpr, DEPTH: tl.constexpr, NORM: tl.constexpr,
             DOCS: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             DP: tl.constexpr, RP: tl.constexpr, VP: tl.constexpr):
    block, bg = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit offsets for large tensors
    b, n = bg // NG, bg % NG
    h = n * G  # the group's first head; its slot j is head h + j
    rows = block * BM + tl.arange(0, BM)
    first, lo = _document_starts(STARTS, b, rows, S, BN, DOCS)
    qo, ro = b * sqs_b + h * sqs_h, b * sr_b + h * sr_h
    ko0, ko1, ko2, ko3 = _shared_heads(b * sks_b, h, SHARE_K, sks_h)
    vo0, vo1, vo2, vo3 = _shared_heads(b * sv_b, h, SHARE_V, sv_h)
    acc0 = tl.zeros([BM, VP], dtype=ACC)
    acc1, acc2, acc3 = acc0, acc0, acc0
    m0 = tl.full([BM], float("-inf"), dtype=ACC)
    m1, m2, m3 = m0, m0, m0
    t0 = tl.zeros([BM], dtype=ACC)
    t1, t2, t3 = t0, t0, t0
    for start in range(lo, tl.minimum((block + 1) * BM, S), BN):
        cols = start + tl.arange(0, BN)
        _, _, _, _, _, _, _, _, f0, f1, f2, f3 = _group_tiles(
            QS, KS, QA, KA, QB, KB, MIX, W1, B1, W2, B2, qo, ko0, ko1, ko2, ko3, ro, sqs_h, sqs_s, sks_s,
            sr_h, sr_s, rows, cols, S, D, R, n, NG, G, HID, DEPTH, IEEE, ACC, DP, RP)
        keep = _keep(rows, cols, first, S)
        acc0, m0, t0 = _accumulate(f0, keep, V, vo0, sv_s, cols, S, DV, acc0, m0, t0, 0, G, NORM, IEEE, VP)
        acc1, m1, t1 = _accumulate(f1, keep, V, vo1, sv_s, cols, S, DV, acc1, m1, t1, 1, G, NORM, IEEE, VP)
        acc2, m2, t2 = _accumulate(f2, keep, V, vo2, sv_s, cols, S, DV, acc2, m2, t2, 2, G, NORM, IEEE, VP)
        acc3, m3, t3 = _accumulate(f3, keep, V, vo3, sv_s, cols, S, DV, acc3, m3, t3, 3, G, NORM, IEEE, VP)
    norm = t0
    if NORM >= 0:
        norm = _normaliser(rows, first, seq_len, NORM)
    oo, lo_ = b * so_b + h * so_h, (b * H + h) * S
    _finish(O, LSE, oo, lo_, so_s, rows, acc0, m0, t0, norm, S, DV, 0, G, NORM, VP)
    _finish(O, LSE, oo + so_h, lo_ + S, so_s, rows, acc1, m1, t1, norm, S, DV, 1, G, NORM, VP)
    _finish(O, LSE, oo + 2 * so_h, lo_ + 2 * S, so_s, rows, acc2, m2, t2, norm, S, DV, 2, G, NORM, VP)
    _finish(O, LSE, oo + 3 * so_h, lo_ + 3 * S, so_s, rows, acc3, m3, t3, norm, S, DV, 3, G, NORM, VP)


@triton.jit
def _row_values(X, base, rows, S, J: tl.constexpr, G: tl.constexpr, ACC: tl.constexpr):
    """Head J's per-row values (log-sum-exp, or the rows' dO . O) for rows, zeros where unused."""
    if J < G:
        out = tl.load(X + base + rows, mask=rows < S, other=0.0).to(ACC)
    else:
        out = tl.zeros([rows.shape[0]], dtype=ACC)
    return out


@triton.jit
def _head_grad(s, keep, do, V, v_base, sv_s, cols, S, DV, lse, delta, norm, J: tl.constexpr, G: tl.constexpr,
               NORM: tl.constexpr, IEEE: tl.constexpr, VP: tl.constexpr):
    """(the weights, the gradient of the scores) of head J's tile from the output's gradient do;
    zeros for unused slots."""
    if J < G:
        v = _slot(V, v_base, sv_s, cols, S, DV, J, G, VP)
        dp = _dot(do, tl.trans(v), IEEE).to(s.dtype)
        if NORM == -1:
            p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
        else:
            active = keep & (s > 0)
            p = tl.where(active, s, 0.0) / norm[:, None]
            ds = tl.where(active, dp / norm[:, None], 0.0)
    else:
        p, ds = s * 0.0, s * 0.0
    return p, ds


@triton.jit
def _key_pass_grad(f, keep, rows, cols, DO, o_base, so_s, V, v_base, sv_s, LSE, DELTA, l_base, S, DV, norm,
                   dv, J: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr, VALUES: tl.constexpr,
                   IEEE: tl.constexpr, ACC: tl.constexpr, VP: tl.constexpr):
    """In a key block's pass, head J's score gradient for queries `rows` and, with VALUES, dv plus
    those queries' share of its values' gradient."""
    do = _slot(DO, o_base, so_s, rows, S, DV, J, G, VP)
    p, d = _head_grad(f, keep, do, V, v_base, sv_s, cols, S, DV, _row_values(LSE, l_base, rows, S, J, G, ACC),
                      _row_values(DELTA, l_base, rows, S, J, G, ACC), norm, J, G, NORM, IEEE, VP)
    if VALUES:
        dv = _grad_step(dv, tl.trans(p), do, J, G, IEEE)
    return d, dv


@triton.jit
def _chain_grads(s0, s1, s2, s3, x0, x1, x2, x3, d0, d1, d2, d3, MIX, W1, B1, W2, B2, PART, PW, n, NG,
                 G: tl.constexpr, HID: tl.constexpr, DEPTH: tl.constexpr, WEIGHTS: tl.constexpr,
                 ACC: tl.constexpr):
    """From the last stage's score gradients d: (those of the first stage's scores, those of the
    source's scores); with WEIGHTS the weights' sums added to PART (per stage, PW apart)."""
    e0, e1, e2, e3 = d0, d1, d2, d3
    if DEPTH == 2:
        m, w1, b1, w2, _ = _stage(MIX, W1, B1, W2, B2, 1, n, NG, G, HID)
        e0, e1, e2, e3 = _align_backward(x0, x1, x2, x3, d0, d1, d2, d3, m, w1, b1, w2, PART + PW, G, HID,
                                         WEIGHTS, ACC)
    m, w1, b1, w2, _ = _stage(MIX, W1, B1, W2, B2, 0, n, NG, G, HID)
    g0, g1, g2, g3 = _align_backward(s0, s1, s2, s3, e0, e1, e2, e3, m, w1, b1, w2, PART, G, HID, WEIGHTS,
                                     ACC)
    return e0, e1, e2, e3, g0, g1, g2, g3


@triton.jit
def _store(X, base, stride, idx, S, width, x, J: tl.constexpr, G: tl.constexpr, WP: tl.constexpr):
    if J < G:
        dims = tl.arange(0, WP)
        tl.store(X + base + idx[:, None] * stride + dims[None, :], x.to(X.dtype.element_ty),
                 mask=(idx[:, None] < S) & (dims[None, :] < width))


@triton.jit
def _store_group(X, base, head_stride, stride, idx, S, width, x0, x1, x2, x3, G: tl.constexpr,
                 WP: tl.constexpr):
    """Store the group's used slots, slot j's rows at base + j * head_stride."""
    _store(X, base, stride, idx, S, width, x0, 0, G, WP)
    _store(X, base + head_stride, stride, idx, S, width, x1, 1, G, WP)
    _store(X, base + 2 * head_stride, stride, idx, S, width, x2, 2, G, WP)
    _store(X, base + 3 * head_stride, stride, idx, S, width, x3, 3, G, WP)


@triton.jit
def _grad_step(acc, a, b, J: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b for used slots."""
    if J < G:
        acc += _dot(a.to(b.dtype), b, IEEE).to(acc.dtype)
    return acc


@triton.jit
def _backward_q(QS, KS, QA, KA, QB, KB, V, MIX, W1, B1, W2, B2, DO, LSE, DELTA, STARTS, DQS, DQA, DQB, PART,
                sqs_b, sqs_h, sqs_s, sks_b, sks_h, sks_s, sr_b, sr_h, sr_s, sv_b, sv_h, sv_s, so_b, so_h,
                so_s, H, NG, S, D, R, DV, SHARE_K, SHARE_V, seq_len, PW, NBLK, WEIGHTS: tl.constexpr,
                G: tl.constexpr, HID: tl.constexpr, DEPTH: tl.constexpr, NORM: tl.constexpr,
                DOCS: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                DP: tl.constexpr, RP: tl.constexpr, VP: tl.constexpr):
    """The gradients of one query block's source and low-rank queries (laid out as they are), or,
    with WEIGHTS, this program's sums for the alignment weights' gradients: apart, as their sums
    and the queries' gradients together would not fit in registers."""
    block, bg = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, n = bg // NG, bg % NG
    h = n * G
    GB: tl.constexpr = G * (DEPTH - 1)
    part = PART + (bg * NBLK + block) * DEPTH * PW  # NBLK: the query blocks of the weights' pass
    rows = block * BM + tl.arange(0, BM)
    first, lo = _document_starts(STARTS, b, rows, S, BN, DOCS)
    qo, ro, oo = b * sqs_b + h * sqs_h, b * sr_b + h * sr_h, b * so_b + h * so_h
    ko0, ko1, ko2, ko3 = _shared_heads(b * sks_b, h, SHARE_K, sks_h)
    vo0, vo1, vo2, vo3 = _shared_heads(b * sv_b, h, SHARE_V, sv_h)
    do0 = _slot(DO, oo, so_s, rows, S, DV, 0, G, VP)
    do1 = _slot(DO, oo + so_h, so_s, rows, S, DV, 1, G, VP)
    do2 = _slot(DO, oo + 2 * so_h, so_s, rows, S, DV, 2, G, VP)
    do3 = _slot(DO, oo + 3 * so_h, so_s, rows, S, DV, 3, G, VP)
    lb = (b * H + h) * S
    lse0, lse1 = _row_values(LSE, lb, rows, S, 0, G, ACC), _row_values(LSE, lb + S, rows, S, 1, G, ACC)
    lse2 = _row_values(LSE, lb + 2 * S, rows, S, 2, G, ACC)
    lse3 = _row_values(LSE, lb + 3 * S, rows, S, 3, G, ACC)
    dl0, dl1 = _row_values(DELTA, lb, rows, S, 0, G, ACC), _row_values(DELTA, lb + S, rows, S, 1, G, ACC)
    dl2 = _row_values(DELTA, lb + 2 * S, rows, S, 2, G, ACC)
    dl3 = _row_values(DELTA, lb + 3 * S, rows, S, 3, G, ACC)
    norm = tl.zeros([BM], dtype=ACC)  # ReLU's n_i (softmax reads none)
    if NORM >= 0:
        norm = _normaliser(rows, first, seq_len, NORM).to(ACC)
    dqs0 = tl.zeros([BM, DP], dtype=ACC)
    dqs1, dqs2, dqs3 = dqs0, dqs0, dqs0
    dqa0 = tl.zeros([BM, RP], dtype=ACC)
    dqa1, dqa2, dqa3 = dqa0, dqa0, dqa0
    dqb0, dqb1, dqb2, dqb3 = dqa0, dqa0, dqa0, dqa0
    for start in range(lo, tl.minimum((block + 1) * BM, S), BN):
        cols = start + tl.arange(0, BN)
        s0, s1, s2, s3, x0, x1, x2, x3, f0, f1, f2, f3 = _group_tiles(
            QS, KS, QA, KA, QB, KB, MIX, W1, B1, W2, B2, qo, ko0, ko1, ko2, ko3, ro, sqs_h, sqs_s, sks_s,
            sr_h, sr_s, rows, cols, S, D, R, n, NG, G, HID, DEPTH, IEEE, ACC, DP, RP)
        keep = _keep(rows, cols, first, S)
        _, d0 = _head_grad(f0, keep, do0, V, vo0, sv_s, cols, S, DV, lse0, dl0, norm, 0, G, NORM, IEEE, VP)
        _, d1 = _head_grad(f1, keep, do1, V, vo1, sv_s, cols, S, DV, lse1, dl1, norm, 1, G, NORM, IEEE, VP)
        _, d2 = _head_grad(f2, keep, do2, V, vo2, sv_s, cols, S, DV, lse2, dl2, norm, 2, G, NORM, IEEE, VP)
        _, d3 = _head_grad(f3, keep, do3, V, vo3, sv_s, cols, S, DV, lse3, dl3, norm, 3, G, NORM, IEEE, VP)
        e0, e1, e2, e3, g0, g1, g2, g3 = _chain_grads(s0, s1, s2, s3, x0, x1, x2, x3, d0, d1, d2, d3, MIX, W1,
                                                      B1, W2, B2, part, PW, n, NG, G, HID, DEPTH, WEIGHTS,
                                                      ACC)
        if not WEIGHTS:
            dqb0 = _grad_tile(dqb0, d0, KB, ro, sr_s, cols, S, R, 0, GB, RP, IEEE)
            dqb1 = _grad_tile(dqb1, d1, KB, ro + sr_h, sr_s, cols, S, R, 1, GB, RP, IEEE)
            dqb2 = _grad_tile(dqb2, d2, KB, ro + 2 * sr_h, sr_s, cols, S, R, 2, GB, RP, IEEE)
            dqb3 = _grad_tile(dqb3, d3, KB, ro + 3 * sr_h, sr_s, cols, S, R, 3, GB, RP, IEEE)
            dqa0 = _grad_tile(dqa0, e0, KA, ro, sr_s, cols, S, R, 0, G, RP, IEEE)
            dqa1 = _grad_tile(dqa1, e1, KA, ro + sr_h, sr_s, cols, S, R, 1, G, RP, IEEE)
            dqa2 = _grad_tile(dqa2, e2, KA, ro + 2 * sr_h, sr_s, cols, S, R, 2, G, RP, IEEE)
            dqa3 = _grad_tile(dqa3, e3, KA, ro + 3 * sr_h, sr_s, cols, S, R, 3, G, RP, IEEE)
            dqs0 = _grad_tile(dqs0, g0, KS, ko0, sks_s, cols, S, D, 0, G, DP, IEEE)
            dqs1 = _grad_tile(dqs1, g1, KS, ko1, sks_s, cols, S, D, 1, G, DP, IEEE)
            dqs2 = _grad_tile(dqs2, g2, KS, ko2, sks_s, cols, S, D, 2, G, DP, IEEE)
            dqs3 = _grad_tile(dqs3, g3, KS, ko3, sks_s, cols, S, D, 3, G, DP, IEEE)
    if not WEIGHTS:
        _store_group(DQS, qo, sqs_h, sqs_s, rows, S, D, dqs0, dqs1, dqs2, dqs3, G, DP)
        _store_group(DQA, ro, sr_h, sr_s, rows, S, R, dqa0, dqa1, dqa2, dqa3, G, RP)
        _store_group(DQB, ro, sr_h, sr_s, rows, S, R, dqb0, dqb1, dqb2, dqb3, GB, RP)


@triton.jit
def _backward_kv(QS, KS, QA, KA, QB, KB, V, MIX, W1, B1, W2, B2, DO, LSE, DELTA, STARTS, ENDS, DKS, DKA, DKB,
                 DV_, sqs_b, sqs_h, sqs_s, sks_b, sks_h, sks_s, sr_b, sr_h, sr_s, sv_b, sv_h, sv_s, so_b,
                 so_h, so_s, H, NG, S, D, R, DV, SHARE_K, SHARE_V, seq_len, KEYS: tl.constexpr,
                 VALUES: tl.constexpr, G: tl.constexpr,
                 HID: tl.constexpr, DEPTH: tl.constexpr, NORM: tl.constexpr, DOCS: tl.constexpr,
                 IEEE: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
                 RP: tl.constexpr, VP: tl.constexpr):
    """The gradients of one key block's source and low-rank keys (KEYS) and its values' (VALUES),
    per query head (DKS, DV_ laid out like the output with widths D and DV; DKA, DKB like the
    low-rank features): apart for groups of several heads, as both would not fit in registers."""
    block, bg = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, n = bg // NG, bg % NG
    h = n * G
    GB: tl.constexpr = G * (DEPTH - 1)
    cols = block * BN + tl.arange(0, BN)
    qo, ro, oo = b * sqs_b + h * sqs_h, b * sr_b + h * sr_h, b * so_b + h * so_h
    ko0, ko1, ko2, ko3 = _shared_heads(b * sks_b, h, SHARE_K, sks_h)
    vo0, vo1, vo2, vo3 = _shared_heads(b * sv_b, h, SHARE_V, sv_h)
    dks0 = tl.zeros([BN, DP], dtype=ACC)
    dks1, dks2, dks3 = dks0, dks0, dks0
    dka0 = tl.zeros([BN, RP], dtype=ACC)
    dka1, dka2, dka3 = dka0, dka0, dka0
    dkb0, dkb1, dkb2, dkb3 = dka0, dka0, dka0, dka0
    dv0 = tl.zeros([BN, VP], dtype=ACC)
    dv1, dv2, dv3 = dv0, dv0, dv0
    if DOCS:  # no query after the block's last document sees it
        hi = tl.max(tl.load(ENDS + b * S + cols, mask=cols < S, other=0), axis=0)
    else:
        hi = S
    lb = (b * H + h) * S
    for start in range(block * BN, hi, BM):  # only queries at or after the block's first key
        rows = start + tl.arange(0, BM)
        first = _starts(STARTS, b, rows, S, DOCS)
        s0, s1, s2, s3, x0, x1, x2, x3, f0, f1, f2, f3 = _group_tiles(
            QS, KS, QA, KA, QB, KB, MIX, W1, B1, W2, B2, qo, ko0, ko1, ko2, ko3, ro, sqs_h, sqs_s, sks_s,
            sr_h, sr_s, rows, cols, S, D, R, n, NG, G, HID, DEPTH, IEEE, ACC, DP, RP)
        keep = _keep(rows, cols, first, S)
        norm = tl.zeros([BM], dtype=ACC)  # ReLU's n_i (softmax reads none)
        if NORM >= 0:
            norm = _normaliser(rows, first, seq_len, NORM).to(ACC)
        d0, dv0 = _key_pass_grad(f0, keep, rows, cols, DO, oo, so_s, V, vo0, sv_s, LSE, DELTA, lb, S, DV,
                                 norm, dv0, 0, G, NORM, VALUES, IEEE, ACC, VP)
        d1, dv1 = _key_pass_grad(f1, keep, rows, cols, DO, oo + so_h, so_s, V, vo1, sv_s, LSE, DELTA, lb + S,
                                 S, DV, norm, dv1, 1, G, NORM, VALUES, IEEE, ACC, VP)
        d2, dv2 = _key_pass_grad(f2, keep, rows, cols, DO, oo + 2 * so_h, so_s, V, vo2, sv_s, LSE, DELTA,
                                 lb + 2 * S, S, DV, norm, dv2, 2, G, NORM, VALUES, IEEE, ACC, VP)
        d3, dv3 = _key_pass_grad(f3, keep, rows, cols, DO, oo + 3 * so_h, so_s, V, vo3, sv_s, LSE, DELTA,
                                 lb + 3 * S, S, DV, norm, dv3, 3, G, NORM, VALUES, IEEE, ACC, VP)
        if KEYS:
            e0, e1, e2, e3, g0, g1, g2, g3 = _chain_grads(s0, s1, s2, s3, x0, x1, x2, x3, d0, d1, d2, d3, MIX,
                                                          W1, B1, W2, B2, MIX, 0, n, NG, G, HID, DEPTH, False,
                                                          ACC)
            dkb0 = _grad_tile(dkb0, tl.trans(d0), QB, ro, sr_s, rows, S, R, 0, GB, RP, IEEE)
            dkb1 = _grad_tile(dkb1, tl.trans(d1), QB, ro + sr_h, sr_s, rows, S, R, 1, GB, RP, IEEE)
            dkb2 = _grad_tile(dkb2, tl.trans(d2), QB, ro + 2 * sr_h, sr_s, rows, S, R, 2, GB, RP, IEEE)
            dkb3 = _grad_tile(dkb3, tl.trans(d3), QB, ro + 3 * sr_h, sr_s, rows, S, R, 3, GB, RP, IEEE)
            dka0 = _grad_tile(dka0, tl.trans(e0), QA, ro, sr_s, rows, S, R, 0, G, RP, IEEE)
            dka1 = _grad_tile(dka1, tl.trans(e1), QA, ro + sr_h, sr_s, rows, S, R, 1, G, RP, IEEE)
            dka2 = _grad_tile(dka2, tl.trans(e2), QA, ro + 2 * sr_h, sr_s, rows, S, R, 2, G, RP, IEEE)
            dka3 = _grad_tile(dka3, tl.trans(e3), QA, ro + 3 * sr_h, sr_s, rows, S, R, 3, G, RP, IEEE)
            dks0 = _grad_tile(dks0, tl.trans(g0), QS, qo, sqs_s, rows, S, D, 0, G, DP, IEEE)
            dks1 = _grad_tile(dks1, tl.trans(g1), QS, qo + sqs_h, sqs_s, rows, S, D, 1, G, DP, IEEE)
            dks2 = _grad_tile(dks2, tl.trans(g2), QS, qo + 2 * sqs_h, sqs_s, rows, S, D, 2, G, DP, IEEE)
            dks3 = _grad_tile(dks3, tl.trans(g3), QS, qo + 3 * sqs_h, sqs_s, rows, S, D, 3, G, DP, IEEE)
    # per query head, laid out [batch, heads, seq, width] (contiguous)
    if VALUES:
        _store_group(DV_, lb * DV, S * DV, DV, cols, S, DV, dv0, dv1, dv2, dv3, G, VP)
    if KEYS:
        _store_group(DKS, lb * D, S * D, D, cols, S, D, dks0, dks1, dks2, dks3, G, DP)
        _store_group(DKA, ro, sr_h, sr_s, cols, S, R, dka0, dka1, dka2, dka3, G, RP)
        _store_group(DKB, ro, sr_h, sr_s, cols, S, R, dkb0, dkb1, dkb2, dkb3, GB, RP)


# (query block, key block, warps) per kernel on a GPU. A group's heads make each tile four tiles, so
# registers bound the tiles: these spill least at the 1B hybrid's sizes among those whose score
# tiles fill the warps' tensor-core tiles (16 x 8 per warp) without copies (bench.kernel_compile
# prints registers and spills for others; the GPU times them in bench.gpu_check). The keys' pass takes
# 16 x 16 with 4 warps, whose score tiles two warps hold twice: its larger tiles spilled up to 1 KB
# per thread.
GPU_TILES = {"forward": (16, 32, 4), "backward_q": (16, 32, 4), "backward_weights": (16, 64, 8),
             "backward_kv": (16, 16, 4), "backward_v": (32, 32, 8)}
# One head per group and linear alignment (queries mixed before the kernel): one product per tile, as
# in flash attention, so the tiles grow to flash attention's 64 x 64 and a key block's pass takes the
# keys' and the values' gradients at once (spilling 28 bytes per thread for sm_90 at the 1B hybrid's
# sizes, where its second pass would recompute every tile; the others spill nothing:
# bench.kernel_compile).
ONE_HEAD_GPU_TILES = {"forward": (64, 64, 4), "backward_q": (64, 64, 8), "backward_weights": (64, 64, 8),
                      "backward_kv": (64, 64, 8)}
INTERPRETED_TILES = (16, 16, 4)  # small: the interpreter runs every tile in numpy


def one_head(group: int, hidden: int) -> bool:
    """Whether the kernels take one head per group with linear alignment (one product per tile)."""
    return group == 1 and hidden == 0


def gpu_tiles(group: int, hidden: int) -> dict:
    return ONE_HEAD_GPU_TILES if one_head(group, hidden) else GPU_TILES


def _tiles(kernel: str, meta: dict) -> dict:
    bm, bn, warps = INTERPRETED_TILES if triton_interpreted() else gpu_tiles(meta["G"], meta["HID"])[kernel]
    return dict(BM=bm, BN=bn, num_warps=warps, num_stages=2)


class _FlashLISA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, norm: int, starts, ends):
        depth = 1 if qb is None else 2
        qs, ks, qa, ka, v, mix = (t.contiguous() for t in (qs, ks, qa, ka, v, mix))
        qb, kb = (qa, ka) if depth == 1 else (qb.contiguous(), kb.contiguous())
        hidden = 0 if w1 is None else w1.shape[-2]
        w1, b1, w2, b2 = (mix, mix, mix, mix) if hidden == 0 else (t.contiguous() for t in (w1, b1, w2, b2))
        batch, heads, seq, width = qs.shape
        rank, dv, group = qa.shape[-1], v.shape[-1], mix.shape[-1]
        groups = heads // group
        # the kernels read the four low-rank features with one set of strides
        assert qa.shape == ka.shape == qb.shape == kb.shape
        assert qa.stride() == ka.stride() == qb.stride() == kb.stride()
        docs = starts is not None
        if not docs:  # unused pointers
            starts = ends = qs
        acc = torch.float64 if qs.dtype == torch.float64 else torch.float32
        out = torch.empty(batch, heads, seq, dv, dtype=v.dtype, device=v.device)
        lse = torch.empty(batch, heads, seq, dtype=acc, device=v.device)
        exact = qs.dtype in (torch.float32, torch.float64)  # else tensor-core products of 16-bit inputs
        meta = dict(G=group, HID=hidden, DEPTH=depth, NORM=norm, DOCS=docs, IEEE=exact,
                    ACC=accumulator(acc), DP=_padded(width),
                    RP=_padded(rank), VP=_padded(dv))
        strides = (*qs.stride()[:3], *ks.stride()[:3], *qa.stride()[:3], *v.stride()[:3], *out.stride()[:3])
        sizes = (heads, groups, seq, width, rank, dv, heads // ks.shape[1], heads // v.shape[1], float(seq))
        tiles = _tiles("forward", meta)
        _forward[(triton.cdiv(seq, tiles["BM"]), batch * groups)](
            qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, out, lse, starts, *strides, *sizes, **meta,
            **tiles)
        ctx.save_for_backward(qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, out, lse, starts, ends)
        ctx.meta, ctx.sizes, ctx.strides = meta, sizes, strides
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, out, lse, starts, ends = ctx.saved_tensors
        meta, sizes, strides = ctx.meta, ctx.sizes, ctx.strides
        group, hidden, depth = meta["G"], meta["HID"], meta["DEPTH"]
        batch, heads, seq, width = qs.shape
        groups, dv = heads // group, v.shape[-1]
        grad_out = grad_out.contiguous()  # read with the output's strides
        delta = lse  # read by softmax sources only: there dO . O per row, [batch, heads, seq]
        if meta["NORM"] == SOFTMAX:
            delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        pw = group * group + (2 * group * hidden + hidden + group if hidden else 0)
        weights = _tiles("backward_weights", meta)
        blocks = triton.cdiv(seq, weights["BM"])
        trained = any(ctx.needs_input_grad[7:12])  # the alignment weights (not a constant mix)
        # each program's slots for the weights' sums (an unused pointer where none is trained)
        part = lse
        if trained:
            part = torch.zeros(batch * groups, blocks, depth, pw, dtype=lse.dtype, device=qs.device)
        dqs, dqa = torch.empty_like(qs), torch.empty_like(qa)
        dqb = torch.empty_like(qb) if depth == 2 else dqa
        args = (qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, grad_out, lse, delta, starts, dqs, dqa, dqb,
                part, *strides, *sizes, pw, blocks)
        queries = _tiles("backward_q", meta)
        _backward_q[(triton.cdiv(seq, queries["BM"]), batch * groups)](*args, WEIGHTS=False, **meta,
                                                                        **queries)
        if trained:
            _backward_q[(blocks, batch * groups)](*args, WEIGHTS=True, **meta, **weights)
        # per query head; in float32 where grouped-query heads sum them, rounded once after the sum
        dks = torch.empty(batch, heads, seq, width, device=ks.device,
                          dtype=ks.dtype if ks.shape[1] == heads else lse.dtype)
        dv_ = torch.empty(batch, heads, seq, dv, device=v.device,
                          dtype=v.dtype if v.shape[1] == heads else lse.dtype)
        dka = torch.empty_like(ka)
        dkb = torch.empty_like(kb) if depth == 2 else dka
        args = (qs, ks, qa, ka, qb, kb, v, mix, w1, b1, w2, b2, grad_out, lse, delta, starts, ends, dks, dka,
                dkb, dv_, *strides, *sizes)
        passes = [(True, False, "backward_kv"), (False, True, "backward_v")]  # keys, then values
        if one_head(group, hidden):  # one product per tile: both in one pass
            passes = [(True, True, "backward_kv")]
        for keys, values, kernel in passes:
            tiles = _tiles(kernel, meta)
            grid = (triton.cdiv(seq, tiles["BN"]), batch * groups)
            _backward_kv[grid](*args, KEYS=keys, VALUES=values, **meta, **tiles)
        # per query head -> per K/V head (a head serves `share` consecutive query heads)
        dks = dks.view(batch, ks.shape[1], -1, seq, width).sum(2).to(ks.dtype)
        dv_ = dv_.view(batch, v.shape[1], -1, seq, dv).sum(2).to(v.dtype)
        dmix, dw = None, [None] * 4
        if trained:
            total = part.view(batch, groups, blocks, depth, pw).sum((0, 2)).transpose(0, 1)  # [depth, ...]
            widths = [group * group] + ([hidden * group, hidden, group * hidden, group] if hidden else [])
            grads = total.split(widths, -1)
            dmix = grads[0].reshape(mix.shape).to(mix.dtype)
            if hidden:
                dw = [g.reshape(p.shape).to(p.dtype) for g, p in zip(grads[1:], (w1, b1, w2, b2))]
        second = (dqb, dkb) if depth == 2 else (None, None)
        return (dqs, dks, dqa, dka, *second, dv_, dmix, *dw, None, None, None)


# Run as it is inside torch.compile'd blocks (train.compile): a graph break, as for the other kernels.
@torch.compiler.disable
def flash_lisa(source_q: torch.Tensor, source_k: torch.Tensor, stages: list[tuple], v: torch.Tensor,
               normalizer: str, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The output [batch, heads, seq, d_v] of a LISA layer from the source's score features
    source_q [batch, heads, seq, d] (scaled) and source_k [batch, heads / share, seq, d], and one or
    two alignment stages (mix, w1, b1, w2, b2, q, k), the first applied first: mix [groups, g, g], w1
    [groups, hidden, g], b1 [groups, hidden], w2 [groups, g, hidden], b2 [groups, g] (w1..b2 None for
    linear alignment) and the stage's low-rank q, k [batch, heads, seq, rank] (q scaled); values v
    [batch, kv_heads, seq, d_v]. normalizer: "softmax", or the ReLU normaliser of relu sources
    (relu_triton.NORMALIZER_CODES); documents: [batch, seq] ids (models.attention.masks)."""
    if len(stages) not in (1, 2):
        raise ValueError(f"flash_lisa takes one or two alignment stages, got {len(stages)}")
    norm = SOFTMAX if normalizer == "softmax" else NORMALIZER_CODES[normalizer]
    acc = torch.float64 if source_q.dtype == torch.float64 else torch.float32
    weights = []
    for i in range(5):
        parts = [stage[i] for stage in stages]
        weights.append(None if parts[0] is None else torch.stack([p.to(acc) for p in parts]))
    (qa, ka), (qb, kb) = stages[0][5:], (stages[1][5:] if len(stages) == 2 else (None, None))
    starts = ends = None
    if documents is not None:
        starts, ends = (t.to(torch.int32).contiguous() for t in document_bounds(documents))
    return _FlashLISA.apply(source_q, source_k, qa, ka, qb, kb, v, *weights, norm, starts, ends)
