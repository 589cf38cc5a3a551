"""The fused LISA alignment kernel (models.attention.kernels.lisa_align_triton) under Triton's
interpreter on CPU, against the PyTorch HeadAlign it replaces, alone and in a model."""

from __future__ import annotations

import json

from tests.test_lisa_decode_kernel import run_interpreted

KERNEL_CHECK = """
import json, sys
import torch
from models.attention.kernels.lisa_align_triton import fused_align
from models.attention.lisa import HeadAlign
from tests.dist_utils import single_process_group

errors = {}
with single_process_group():
    for heads, group, hidden, rows, keys, dtype in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(0)
        align = HeadAlign(heads, heads, group, hidden).to(dtype)
        with torch.no_grad():
            for p in align.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.5)
        wide = torch.randn(2, heads, rows, keys + 3, generator=gen, dtype=dtype)
        scores = wide[..., :keys].requires_grad_()  # a view, as kept score rows are cut
        ref = align(scores, recompute_rows=False)
        weight = torch.randn(ref.shape, generator=gen, dtype=dtype)
        params = [align.mix, align.w1, align.b1, align.w2, align.b2]
        want = torch.autograd.grad((ref * weight).sum(), [scores, *params])
        out = fused_align(scores, *params)
        got = torch.autograd.grad((out * weight).sum(), [scores, *params])
        assert out.dtype == dtype and out.shape == ref.shape
        assert all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))
        key = f"{heads}/{group}/{hidden}/{rows}x{keys}/{dtype}"
        errors[key] = [float((out - ref).abs().max() / ref.abs().max())]
        errors[key] += [float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
print(json.dumps(errors))
"""

MODEL_CHECK = """
import json
import torch
import models.attention.kernels.lisa_align_triton as fused
from models.attention.lisa import LISAAttention

# The path by query blocks, whose FFN alignment this kernel runs where the fused LISA kernel does not
# (chains longer than two, groups over four heads).
LISAAttention.flash = lambda self, *args: None
from tests.test_attention import VOCAB, ffn_chain_model

calls = []
kernel = fused.fused_align
fused.fused_align = lambda *a: calls.append(a[0].shape[-2]) or kernel(*a)
# one sequence: the test of the kernel alone covers batches
tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
from tests.dist_utils import single_process_group
results, counts = {}, {}
with single_process_group():
    for name, kernel_name, keep in (("auto", "auto", False), ("auto-keep", "auto", True),
                                    ("torch", "torch", False), ("naive", "naive", False)):
        model = ffn_chain_model(kernel_name, keep)
        before = len(calls)
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        counts[name] = len(calls) - before
        results[name] = (float(loss), {n: p.grad for n, p in model.named_parameters()})
ref_loss, ref_grads = results["naive"]
# per gradient, the largest error past torch.testing.assert_close's rtol=1e-9, atol=1e-10 (<= 0: close)
errors = {name: [abs(loss - ref_loss)] + [float(((grads[n] - g).abs() - 1e-10 - 1e-9 * g.abs()).max())
                                          for n, g in ref_grads.items()]
          for name, (loss, grads) in results.items()}
print(json.dumps({"errors": errors, "calls": counts}))
"""


def test_fused_alignment_equals_head_align_under_interpreter():
    """Output and the gradients of the scores and of every alignment weight: groups of 4, 3 and 2,
    hidden widths 16, 5 and 40 (padded to 16, 16 and 64 inside the kernel), several groups and
    batches, positions that are not a multiple of the kernel's block, scores that are a view;
    float64 and float32."""
    cases = [[8, 4, 16, 5, 37, "float64"], [6, 3, 5, 7, 11, "float64"], [4, 2, 40, 3, 30, "float64"],
             [4, 4, 16, 9, 20, "float32"]]
    errors = run_interpreted(KERNEL_CHECK, json.dumps(cases))
    assert len(errors) == len(cases)
    for case, errs in errors.items():
        assert len(errs) == 7
        assert max(errs) < (1e-5 if case.endswith("float32") else 1e-12), (case, errs)


def test_model_trains_through_fused_alignment_as_explicit_scores():
    """A model with a chain of FFN-aligned LISA layers after softmax and relu layers (grouped-query
    heads, blocks of 5 query rows, one sequence of 24) gives the loss and every gradient of the explicit
    scores (kernel=naive) with its alignment in the fused kernel (kernel=auto, rebuilding the chain
    and keeping its rows) and in PyTorch (kernel=torch, which never calls the kernel); float64."""
    out = run_interpreted(MODEL_CHECK)
    calls, errors = out["calls"], out["errors"]
    assert calls["torch"] == 0 and calls["naive"] == 0, calls
    # LISA layers 1-3 and 5-6, five row blocks each, built in forward and again in backward: each layer
    # aligns its own rows (keep), or those of every layer of its chain so far (rebuild)
    assert calls["auto-keep"] == 2 * 5 * 5 and calls["auto"] == 2 * 5 * (1 + 2 + 3 + 1 + 2), calls
    for name in ("auto", "auto-keep", "torch"):
        assert errors[name][0] < 1e-12 and max(errors[name][1:]) <= 0, (name, errors[name])
