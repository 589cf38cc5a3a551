"""LISA's head alignment with the FFN (models.attention.lisa.HeadAlign) as one Triton kernel
forward and one backward (GPU):

    out[h] = sum_g M[h, g] S[g] + W2[h] . GELU(W1 S + b1) + b2[h]      pointwise over positions

within each group of g heads. The PyTorch path runs it as small matmuls over the group's heads
(inner sizes g and align_hidden, which tensor cores barely use) and elementwise passes over the
hidden activations, align_hidden / g times the scores' size: about twenty passes over memory in
forward and again in backward (recomputed), where this kernel reads the scores once and writes
the output once. A program takes a block of positions of one group: the scores [g, block] (g
padded to 16 with zeros, as tl.dot needs) go through three 16-wide tl.dot products kept in
registers. Backward recomputes the hidden layer from the scores and writes their gradient; each
program sums the weights' gradients over several blocks in registers and writes them once, and
those partial sums are added up after the kernel. Blocks of positions are the grid's first axis
(CUDA allows 65535 programs on the others). Under TRITON_INTERPRET=1 both run on CPU tensors (how
the tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.attention.kernels.triton_dot import dot as _dot
from models.triton_launch import accumulator, triton_interpreted


@triton.jit
def _gelu_and_slope(x):
    """GELU (exact, as F.gelu) and its derivative."""
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327


@triton.jit
def _load_weights(MIX, W1, B1, W2, n, G, HID, ACC: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr):
    """Group n's M [GP, GP], W1 [HP, GP], b1 [HP], W2 [GP, HP], zero outside [G, HID]."""
    gs, hs = tl.arange(0, GP), tl.arange(0, HP)
    g_ok, h_ok = gs < G, hs < HID
    gg, hg, gh = g_ok[:, None] & g_ok[None, :], h_ok[:, None] & g_ok[None, :], g_ok[:, None] & h_ok[None, :]
    mix = tl.load(MIX + n * G * G + gs[:, None] * G + gs[None, :], mask=gg, other=0.0)
    w1 = tl.load(W1 + n * HID * G + hs[:, None] * G + gs[None, :], mask=hg, other=0.0)
    b1 = tl.load(B1 + n * HID + hs, mask=h_ok, other=0.0)
    w2 = tl.load(W2 + n * G * HID + gs[:, None] * HID + hs[None, :], mask=gh, other=0.0)
    return mix.to(ACC), w1.to(ACC), b1.to(ACC), w2.to(ACC)


@triton.jit
def _align_forward(S, OUT, MIX, W1, B1, W2, B2, P, G, HID, GROUPS, IEEE: tl.constexpr, ACC: tl.constexpr,
                   GP: tl.constexpr, HP: tl.constexpr, BLOCK: tl.constexpr):
    bg = tl.program_id(1).to(tl.int64)  # (batch, group): its g heads' scores are consecutive [g, P]
    n = bg % GROUPS
    gs, cols = tl.arange(0, GP), tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    where = bg * G * P + gs[:, None] * P + cols[None, :]
    ok = (gs[:, None] < G) & (cols[None, :] < P)
    s = tl.load(S + where, mask=ok, other=0.0).to(ACC)
    mix, w1, b1, w2 = _load_weights(MIX, W1, B1, W2, n, G, HID, ACC, GP, HP)
    b2 = tl.load(B2 + n * G + gs, mask=gs < G, other=0.0).to(ACC)
    hidden, _ = _gelu_and_slope(_dot(w1, s, IEEE) + b1[:, None])
    out = _dot(mix, s, IEEE) + _dot(w2, hidden, IEEE) + b2[:, None]
    tl.store(OUT + where, out.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _align_backward(S, DOUT, DS, MIX, W1, B1, W2, PARTS, P, G, HID, GROUPS, PROGRAMS, IEEE: tl.constexpr,
                    ACC: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, BLOCK: tl.constexpr,
                    STEPS: tl.constexpr):
    program, bg = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n = bg % GROUPS
    gs, hs = tl.arange(0, GP), tl.arange(0, HP)
    mix, w1, b1, w2 = _load_weights(MIX, W1, B1, W2, n, G, HID, ACC, GP, HP)
    dmix, dw2, db2 = tl.zeros([GP, GP], ACC), tl.zeros([GP, HP], ACC), tl.zeros([GP], ACC)
    dw1, db1 = tl.zeros([HP, GP], ACC), tl.zeros([HP], ACC)
    for step in range(STEPS):  # this program's STEPS blocks of positions
        cols = (program * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
        where = bg * G * P + gs[:, None] * P + cols[None, :]
        ok = (gs[:, None] < G) & (cols[None, :] < P)
        s = tl.load(S + where, mask=ok, other=0.0).to(ACC)
        dout = tl.load(DOUT + where, mask=ok, other=0.0).to(ACC)  # zero outside: no gradient from padding
        hidden, slope = _gelu_and_slope(_dot(w1, s, IEEE) + b1[:, None])
        dpre = _dot(tl.trans(w2), dout, IEEE) * slope  # [HP, BLOCK]: gradient before the GELU
        ds = _dot(tl.trans(mix), dout, IEEE) + _dot(tl.trans(w1), dpre, IEEE)
        tl.store(DS + where, ds.to(DS.dtype.element_ty), mask=ok)
        dmix += _dot(dout, tl.trans(s), IEEE)
        dw2 += _dot(dout, tl.trans(hidden), IEEE)
        db2 += tl.sum(dout, axis=1)
        dw1 += _dot(dpre, tl.trans(s), IEEE)
        db1 += tl.sum(dpre, axis=1)
    # [M | W2 | b2] rows per head, then [W1 | b1] per hidden unit
    part = PARTS + (bg * PROGRAMS + program) * (GP * (GP + HP + 1) + HP * (GP + 1))
    tl.store(part + gs[:, None] * GP + gs[None, :], dmix)
    part += GP * GP
    tl.store(part + gs[:, None] * HP + hs[None, :], dw2)
    part += GP * HP
    tl.store(part + gs, db2)
    part += GP
    tl.store(part + hs[:, None] * GP + gs[None, :], dw1)
    part += HP * GP
    tl.store(part + hs, db1)


BACKWARD_BLOCKS = (64, 32)  # (positions per block, blocks per program) of the backward kernel on a GPU


def _sizes(scores: torch.Tensor, mix: torch.Tensor, w1: torch.Tensor) -> dict:
    groups, group, hidden = mix.shape[0], mix.shape[-1], w1.shape[1]
    interpreted = triton_interpreted()
    return dict(GP=max(16, triton.next_power_of_2(group)), HP=max(16, triton.next_power_of_2(hidden)),
                IEEE=scores.dtype in (torch.float32, torch.float64),
                ACC=accumulator(scores.dtype),
                groups=groups, group=group, hidden=hidden, interpreted=interpreted)


class _FusedAlign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mix, w1, b1, w2, b2):
        k = ctx.sizes = _sizes(scores, mix, w1)
        scores, mix, w1, b1, w2, b2 = (t.contiguous() for t in (scores, mix, w1, b1, w2, b2))
        batch, heads = scores.shape[:2]
        positions = scores[0, 0].numel()
        out = torch.empty_like(scores)
        block = 32 if k["interpreted"] else 256
        grid = (triton.cdiv(positions, block), batch * heads // k["group"])
        _align_forward[grid](scores, out, mix, w1, b1, w2, b2, positions, k["group"], k["hidden"],
                             k["groups"], IEEE=k["IEEE"], ACC=k["ACC"], GP=k["GP"], HP=k["HP"], BLOCK=block)
        ctx.save_for_backward(scores, mix, w1, b1, w2, b2)
        return out

    @staticmethod
    def backward(ctx, dout):
        scores, mix, w1, b1, w2, b2 = ctx.saved_tensors
        k = ctx.sizes
        gp, hp, group, hidden, groups = k["GP"], k["HP"], k["group"], k["hidden"], k["groups"]
        batch, heads = scores.shape[:2]
        positions = scores[0, 0].numel()
        # Blocks of positions per program: the weights' partial sums (800 floats at 16 x 16) then take
        # about a fifth of the bf16 scores' bytes at groups of 4; the interpreter's two test the loop.
        # Blocks of 64: at 128 the kernel spilled 1.3 KB per thread for sm_90 (bench.kernel_compile).
        block, steps = (32, 2) if k["interpreted"] else BACKWARD_BLOCKS
        programs = triton.cdiv(positions, block * steps)
        acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
        width = gp * (gp + hp + 1) + hp * (gp + 1)
        parts = torch.empty(batch * heads // group, programs, width, dtype=acc, device=scores.device)
        dscores = torch.empty_like(scores)
        _align_backward[(programs, batch * heads // group)](
            scores, dout.contiguous(), dscores, mix, w1, b1, w2, parts, positions, group, hidden, groups,
            programs, IEEE=k["IEEE"], ACC=k["ACC"], GP=gp, HP=hp, BLOCK=block, STEPS=steps)
        total = parts.view(batch, groups, programs, width).sum((0, 2))  # per group
        dmix, dw2, db2, dw1, db1 = total.split([gp * gp, gp * hp, gp, hp * gp, hp], dim=1)
        grads = (dmix.view(groups, gp, gp)[:, :group, :group], dw1.view(groups, hp, gp)[:, :hidden, :group],
                 db1[:, :hidden], dw2.view(groups, gp, hp)[:, :group, :hidden], db2[:, :group])
        return dscores, *(g.to(p.dtype) for g, p in zip(grads, (mix, w1, b1, w2, b2)))


# Run as it is inside torch.compile'd blocks (train.compile): a graph break, rather than tracing the
# launches of an autograd.Function that no compiled test has run on a GPU.
@torch.compiler.disable
def fused_align(scores: torch.Tensor, mix: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor) -> torch.Tensor:
    """scores [batch, heads, rows, keys] -> the aligned scores, same shape and dtype; heads in
    consecutive groups of g, group n's weights mix[n] [g, g], w1[n] [hidden, g], b1[n] [hidden],
    w2[n] [g, hidden], b2[n] [g] (any dtype; used in float32, float64 for float64 scores)."""
    return _FusedAlign.apply(scores, mix, w1, b1, w2, b2)
