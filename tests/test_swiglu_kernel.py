"""The Triton SwiGLU kernel (models.mlp.swiglu_triton) under Triton's interpreter on CPU, against
models.layers.swiglu's formula: output and input gradient."""

from __future__ import annotations

from tests.test_lisa_decode_kernel import run_interpreted

CHECK = """
import json
import torch
from models.layers import swiglu
from models.mlp.swiglu_triton import swiglu as fused

errors = {}
for dtype, rows, width in ((torch.float64, 37, 24), (torch.float64, 3, 1030), (torch.float32, 5, 200),
                          (torch.bfloat16, 4, 40)):
    gen = torch.Generator().manual_seed(0)
    # a linear layer's output, seen through a transpose as projections often are: not contiguous
    gate_up = (torch.randn(2 * width, rows, generator=gen, dtype=dtype) * 3).t().requires_grad_()
    weight = torch.randn(rows, width, generator=gen, dtype=dtype)
    want = swiglu(gate_up)  # the formula (CPU)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), gate_up)
    got = fused(gate_up)
    (got_grad,) = torch.autograd.grad((got * weight).sum(), gate_up)
    assert got.shape == want.shape and got.dtype == dtype and got_grad.shape == gate_up.shape
    scale = float(want.abs().max())
    errors[f"{dtype}/{rows}x{width}"] = [float((got - want).abs().max()) / scale,
                                         float((got_grad - want_grad).abs().max() / want_grad.abs().max())]
empty = torch.zeros(0, 8, requires_grad=True)  # an expert without rows
fused(empty).sum().backward()
assert fused(empty).shape == (0, 4) and empty.grad.shape == (0, 8)
print(json.dumps(errors))
"""


def test_fused_swiglu_equals_the_formula_under_interpreter():
    """Interleaved gate/up rows, not contiguous, widths past one block of the kernel and not a
    multiple of it, float64, float32 and bfloat16 (the kernel rounds once, the formula after each
    operation): the output and the gradient of gate_up equal the formula's;
    no rows (an expert without tokens) give empty results."""
    errors = run_interpreted(CHECK)
    assert len(errors) == 4
    for case, (output, grad) in errors.items():
        tolerances = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.bfloat16": 2e-2}
        tolerance = tolerances[case.split("/")[0]]
        assert output < tolerance and grad < tolerance, (case, output, grad)
