"""The Triton SwiGLU kernel (models.mlp.kernels.swiglu_triton) under Triton's interpreter on CPU, against
models.layers.swiglu's formula: output, input gradient and what each keeps for backward."""

from __future__ import annotations

from tests.test_lisa_decode_kernel import run_interpreted

CHECK = """
import json
import torch
import torch.nn.functional as F
from models.layers import swiglu
from models.mlp.kernels.swiglu_triton import swiglu as fused

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

kept_per_neuron = {}  # an MLP's saved activations (distinct storages, not its weights or input)
tokens, hidden, width = 12, 16, 40
x = torch.randn(tokens, hidden)
w_in = torch.randn(2 * width, hidden, requires_grad=True)
w_out = torch.randn(hidden, width, requires_grad=True)
for name, activation in (("formula", swiglu), ("fused", fused)):
    storages = {}
    def keep(t):
        if t.data_ptr() not in (x.data_ptr(), w_in.data_ptr(), w_out.data_ptr()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = F.linear(activation(F.linear(x, w_in)), w_out)
    out.sum().backward()
    kept_per_neuron[name] = sum(storages.values()) / (tokens * width)
print(json.dumps({"errors": errors, "kept_per_neuron": kept_per_neuron}))
"""


def test_fused_swiglu_equals_the_formula_and_keeps_what_the_planner_counts():
    """Interleaved gate/up rows, not contiguous, widths past one block of the kernel and not a
    multiple of it, float64, float32 and bfloat16 (the kernel rounds once, the formula after each
    operation): the output and the gradient of gate_up equal the formula's;
    no rows (an expert without tokens) give empty results. A SwiGLU MLP keeps for backward what the
    planner's dense MLP term counts per neuron, with the kernel (3) and with the formula (4)."""
    from models.config import ModelConfig
    from models.registry import ActivationLayout, mlp_kind

    result = run_interpreted(CHECK)
    cfg = ModelConfig(ffn_hidden_size=64)
    for fused, name in ((True, "fused"), (False, "formula")):
        layout = ActivationLayout(tensor=1, seq=8, flash=False, selective=False, fused_swiglu=fused)
        planned = mlp_kind("dense").activations(cfg, layout) / cfg.ffn_hidden_size
        assert result["kept_per_neuron"][name] == planned, (name, result["kept_per_neuron"], planned)
    errors = result["errors"]
    assert len(errors) == 4
    for case, (output, grad) in errors.items():
        tolerances = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.bfloat16": 2e-2}
        tolerance = tolerances[case.split("/")[0]]
        assert output < tolerance and grad < tolerance, (case, output, grad)
