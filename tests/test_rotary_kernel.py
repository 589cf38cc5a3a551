"""The Triton RoPE kernel (models.attention.kernels.rotary_triton) under Triton's interpreter on
CPU, against models.layers.Rotary's formula: output and input gradient."""

from __future__ import annotations

from tests.test_lisa_decode_kernel import run_interpreted

CHECK = """
import json
import torch
from models.attention.kernels.rotary_triton import rotary
from models.layers import Rotary

errors = {}
for dtype, head_dim, offset in ((torch.float64, 12, 0), (torch.float64, 16, 5), (torch.float32, 40, 3),
                               (torch.float64, 2, 1)):  # 2: the narrowest LISA low-rank keys
    rope = Rotary(head_dim, 64, 10000.0)
    gen = torch.Generator().manual_seed(0)
    # [batch, seq, heads, head_dim] seen as [batch, heads, seq, head_dim], as attention's q and k are
    x = torch.randn(2, 19, 3, head_dim, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    weight = torch.randn(2, 3, 19, head_dim, generator=gen, dtype=dtype)
    want = rope(x, offset)  # the formula (CPU)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), x)
    got = rotary(x, rope.cos[offset:offset + 19], rope.sin[offset:offset + 19])
    (got_grad,) = torch.autograd.grad((got * weight).sum(), x)
    assert got.is_contiguous() and got.dtype == dtype
    errors[f"{dtype}/{head_dim}/{offset}"] = [float((got - want).abs().max()),
                                              float((got_grad - want_grad).abs().max()),
                                              float((got - x).abs().max())]
print(json.dumps(errors))
"""


def test_fused_rotary_equals_the_formula_under_interpreter():
    """Strided [batch, heads, seq, head_dim] inputs (as attention's q and k), at an offset (decoding),
    head widths that are and are not powers of two (down to 2, LISA's smallest rank), float64 and
    float32: the output and the input's gradient (the rotation by minus the angles) equal the
    formula's."""
    errors = run_interpreted(CHECK)
    assert len(errors) == 4
    for case, (output, grad, moved) in errors.items():
        tolerance = 1e-12 if "float64" in case else 1e-5
        assert output < tolerance and grad < tolerance and moved > 0.1, (case, output, grad, moved)
