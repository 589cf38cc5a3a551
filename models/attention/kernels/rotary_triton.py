"""Rotary position embedding (half-split layout, models.layers.Rotary) as one Triton kernel, forward
and backward. Eagerly, PyTorch runs the formula as seven kernels (two halves times cos and sin, their
sum and difference, a cat of strided halves) and its backward about as many (in the H200 profile
of an eager 1B dense step, aten::mul and aten::cat, RoPE's among others, took 10% and 7% of the GPU
time). Here a pass reads x once and writes the rotated copy once, in float32 within the kernel.
Backward is the rotation by minus the angles. Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (how the
tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.triton_launch import accumulator, on_its_device


@triton.jit
def _rotate(X, COS, SIN, OUT, sx_b, sx_h, sx_s, heads, seq, HALF: tl.constexpr, HP: tl.constexpr,
            BS: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr):
    bh, block = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit offsets for large tensors
    b, h = bh // heads, bh % heads
    pos = block * BS + tl.arange(0, BS)
    dims = tl.arange(0, HP)
    mask = (pos[:, None] < seq) & (dims[None, :] < HALF)
    x = X + b * sx_b + h * sx_h + pos[:, None].to(tl.int64) * sx_s + dims[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(ACC)
    angle = pos[:, None] * HALF + dims[None, :]
    cos = tl.load(COS + angle, mask=mask, other=0.0).to(ACC)
    sin = tl.load(SIN + angle, mask=mask, other=0.0).to(ACC) * SIGN
    out = OUT + (bh * seq + pos[:, None]) * (2 * HALF) + dims[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x [batch, heads, seq, 2 * half] (any strides but the last) rotated by sign x the angles of
    cos / sin [seq, half]; contiguous."""
    batch, heads, seq, width = x.shape
    half = width // 2
    if width % 2 or cos.shape != (seq, half) or sin.shape != (seq, half) or cos.device != x.device:
        raise ValueError(f"RoPE of x {tuple(x.shape)} needs cos / sin [{seq}, {half}] on {x.device}, "
                         f"got {tuple(cos.shape)} / {tuple(sin.shape)} on {cos.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(batch, heads, seq, width, dtype=x.dtype, device=x.device)
    padded = triton.next_power_of_2(half)
    rows = max(1, min(64, 4096 // padded))
    if not out.numel():
        return out
    grid = (batch * heads, triton.cdiv(seq, rows))
    with on_its_device(x):
        _rotate[grid](x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), x.stride(2),
                      heads, seq, HALF=half, HP=padded, BS=rows, SIGN=sign, ACC=accumulator(x.dtype))
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotated(x, cos, sin, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward has no graph of its own
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotated(grad, cos, sin, -1), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [batch, heads, seq, head_dim] with cos / sin [seq, head_dim / 2] (float32)."""
    return _Rotary.apply(x, cos, sin)
