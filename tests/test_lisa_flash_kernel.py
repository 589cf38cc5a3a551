"""The fused LISA kernel (models.attention.kernels.lisa_flash_triton) under Triton's interpreter on
CPU: against a plain implementation of LISA's scores and attention, and inside a model against the
explicit scores (kernel=naive)."""

from __future__ import annotations

import json

from tests.test_lisa_decode_kernel import run_interpreted

KERNEL_CHECK = """
import json, sys
import torch
import torch.nn.functional as F
import models.attention.kernels.lisa_flash_triton as fused
from models.attention.kernels.lisa_flash_triton import flash_lisa

interpreted = fused.triton_interpreted


def align(s, mix, w1, b1, w2, b2):
    b, h, sq, sk = s.shape
    g = mix.shape[-1]
    x = s.view(b, h // g, g, sq, sk)
    out = torch.einsum("nhj,bnjst->bnhst", mix, x)
    if w1 is not None:
        hid = F.gelu(torch.einsum("nuj,bnjst->bnust", w1, x) + b1[None, :, :, None, None])
        out = out + torch.einsum("nhu,bnust->bnhst", w2, hid) + b2[None, :, :, None, None]
    return out.reshape(s.shape)


def reference(qs, ks, stages, v, normalizer, documents):
    b, h, seq, _ = qs.shape
    s = qs @ ks.repeat_interleave(h // ks.shape[1], 1).transpose(-2, -1)
    for mix, w1, b1, w2, b2, q, k in stages:
        s = align(s, mix, w1, b1, w2, b2) + q @ k.transpose(-2, -1)
    pos = torch.arange(seq)
    visible = (pos[None, :] <= pos[:, None]).expand(b, seq, seq)
    seen = (pos + 1.0).expand(b, seq)
    if documents is not None:
        same = documents[:, :, None] == documents[:, None, :]
        visible = visible & same
        seen = visible.sum(-1).to(s.dtype)
    visible = visible[:, None]
    if normalizer == "softmax":
        w = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    else:
        n = {"none": torch.ones_like(seen), "prefix": seen, "content": (seen - 1).clamp(min=1),
             "seqlen": torch.full_like(seen, float(seq))}[normalizer]
        w = torch.relu(s) * visible / n[:, None, :, None]
    return w @ v.repeat_interleave(h // v.shape[1], 1)


errors = {}
for normalizer, heads, group, hidden, kv, depth, d, rank, dv, seq, docs, dtype, tiles, mix in json.loads(
        sys.argv[1]):
    dtype = getattr(torch, dtype)
    # "gpu": the tile sizes the kernels launch with on a GPU (GPU_TILES) instead of the interpreter's
    fused.triton_interpreted = (lambda: False) if tiles == "gpu" else interpreted
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_()
    b, groups = 2, heads // group
    qs, ks = r(b, heads, seq, d, scale=0.5), r(b, kv, seq, d, scale=0.5)
    v = r(b, kv, seq, dv)
    stages = []
    for _ in range(depth):
        ffn = (None,) * 4
        if hidden:
            ffn = (r(groups, hidden, group), r(groups, hidden), r(groups, group, hidden, scale=0.5),
                   r(groups, group))
        mixing = r(groups, group, group, scale=0.7)
        if mix == "constant":  # needs no gradient: the kernel skips the alignment weights' pass
            mixing = mixing.detach()
        stages.append((mixing, *ffn, r(b, heads, seq, rank, scale=0.5), r(b, heads, seq, rank, scale=0.5)))
    documents = None
    if docs:
        documents = torch.cumsum(torch.rand(b, seq, generator=gen) < 0.15, 1)
    inputs = [qs, ks, v] + [t for st in stages for t in st if t is not None and t.requires_grad]
    ref = reference(qs, ks, stages, v, normalizer, documents)
    weight = torch.randn(ref.shape, generator=gen, dtype=dtype)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    out = flash_lisa(qs, ks, stages, v, normalizer, documents)
    got = torch.autograd.grad((out * weight).sum(), inputs)
    key = f"{normalizer}/{heads}h/g{group}/hid{hidden}/kv{kv}/depth{depth}/{d},{rank},{dv}/seq{seq}"
    key += f"/docs{docs}/{mix}-mix/{tiles}-tiles/{dtype}"
    # the output relative to its largest value, gradients to max(1, their largest)
    errors[key] = [float((out.detach() - ref.detach()).abs().max() / ref.abs().max())]
    assert out.dtype == dtype and all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))
    errors[key] += [float((g - w).abs().max() / max(1.0, float(w.abs().max()))) for g, w in zip(got, want)]
print(json.dumps(errors))
"""

MODEL_CHECK = """
import json
import torch
import models.attention.kernels.lisa_flash_triton as fused
from models.attention.lisa import chain_depths, fused_depth
from models.registry import ActivationLayout
from tests.dist_utils import single_process_group
from tests.test_attention import VOCAB, ffn_chain_model, linear_mixing_model

calls, groups, sources = [], [], []  # per kernel call: its stages, heads per group, source queries
kernel = fused.flash_lisa
fused.flash_lisa = lambda *a: (calls.append(len(a[2])) or groups.append(a[2][0][0].shape[-1])
                               or sources.append(a[0].data_ptr()) or kernel(*a))
gen = torch.Generator().manual_seed(3)
# one sequence (the kernel test covers batches) of ten documents, one across the two query blocks
tokens = torch.randint(0, VOCAB, (1, 24), generator=gen)
documents = torch.cumsum(torch.rand(1, 24, generator=gen) < 0.2, 1)
results, depths, taken, planned = {}, {}, {}, {}
gpu = ActivationLayout(tensor=1, seq=24, flash=True, selective=False)
with single_process_group():
    for name, kernel_name, docs in (("auto", "auto", None), ("auto-docs", "auto", documents),
                                    ("naive", "naive", None), ("naive-docs", "naive", documents),
                                    ("linear-auto", "auto", None), ("linear-naive", "naive", None),
                                    ("linear-gqa-auto", "auto", None), ("linear-gqa-naive", "naive", None)):
        if name.startswith("linear"):
            model = linear_mixing_model(kernel_name, 2 if "gqa" in name else 0)
        else:
            model = ffn_chain_model(kernel_name, True)  # no rows kept where the kernel runs: layer 3 rebuilds
        before = len(calls)
        loss = model(tokens, torch.roll(tokens, -1, 1), docs)
        loss.backward()
        depths[name], taken[name] = calls[before:], groups[before:]
        # the planner's view: the chain depths at which the kernel runs
        fused = fused_depth(model.cfg, gpu)
        planned[name] = [d for d in chain_depths(model.cfg.attention_kinds()) if 0 < d <= fused]
        if name == "linear-gqa-auto":  # one tensor of mixed queries for layer 1's kernel and layer 2's
            shared_queries = sources[before] == sources[before + 1]
        results[name] = (float(loss), {n: p.grad for n, p in model.named_parameters()})
errors = {}
for name, (loss, grads) in results.items():
    ref_loss, ref_grads = results["naive-docs" if name.endswith("docs") else name.replace("auto", "naive")]
    # per gradient, the largest error past torch.testing.assert_close's rtol=1e-9, atol=1e-10 (<= 0: close)
    errors[name] = [abs(loss - ref_loss)] + [float(((grads[n] - g).abs() - 1e-10 - 1e-9 * g.abs()).max())
                                             for n, g in ref_grads.items()]
print(json.dumps({"errors": errors, "depths": depths, "groups": taken, "planned": planned,
                  "shared_queries": shared_queries}))
"""


def test_fused_lisa_equals_plain_lisa_under_interpreter():
    """Output and every gradient (source features, values, alignment weights, low-rank features of
    each stage) against a plain implementation: softmax and every ReLU normaliser; one stage and a
    chain of two; groups of 4, 3, 2 and 1, FFN widths 16 and 5 and linear alignment; grouped-query
    keys and values; widths and lengths that are not powers of two or multiples of the blocks;
    within documents; float64 and float32; at the interpreter's tile sizes and, over several blocks
    of each, at those the kernels launch with on a GPU (groups of 4 with the FFN alignment; one head
    per group with linear alignment, its mixing trained or constant, which skips the weights'
    pass)."""
    cases = [["softmax", 8, 4, 5, 2, 2, 8, 2, 8, 21, False, "float64", "interpreter", "trained"],
             ["prefix", 6, 3, 16, 3, 2, 12, 6, 8, 21, False, "float64", "interpreter", "trained"],
             ["content", 4, 2, 0, 1, 1, 8, 4, 16, 33, True, "float64", "interpreter", "trained"],
             ["none", 2, 1, 3, 2, 1, 8, 4, 8, 17, False, "float64", "interpreter", "trained"],
             ["seqlen", 4, 4, 16, 4, 2, 16, 16, 16, 20, False, "float32", "interpreter", "trained"],
             ["softmax", 4, 4, 16, 2, 2, 8, 4, 8, 80, True, "float64", "gpu", "trained"],
             # one head per group with linear alignment: its own tiles, keys and values in one pass
             ["softmax", 4, 1, 0, 2, 1, 8, 4, 8, 150, True, "float64", "gpu", "trained"],
             ["prefix", 4, 1, 0, 2, 1, 8, 4, 8, 70, False, "float64", "gpu", "constant"]]
    errors = run_interpreted(KERNEL_CHECK, json.dumps(cases))
    assert len(errors) == len(cases)
    for case, errs in errors.items():
        inputs = 18 if "depth2" in case else 11 if "hid0" not in case else 7
        assert len(errs) == inputs - ("constant-mix" in case), (case, errs)
        assert max(errs) < (1e-5 if case.endswith("float32") else 1e-12), (case, errs)


def test_model_trains_through_fused_lisa_as_explicit_scores():
    """A model with LISA chains of three after a softmax layer and of two after a relu layer
    (grouped-query heads, FFN alignment in groups of 2, one sequence of 24) gives the loss and
    every gradient of the explicit scores (kernel=naive) with kernel=auto: the kernel runs the
    first two layers of each chain (the second rebuilding the first's alignment), the third layer
    builds its rows by blocks from the second's (keep_chain_scores on); also within documents;
    float64. The same for linear alignment whose groups read two key heads each, and with one key
    head per group, where the kernel takes the queries of the LISA layers right after full layers
    mixed, one head at a time; in both it runs a chain's second layer on the first one's mixed
    queries and keys (its low-rank term added first). The planner (fused_depth) names the same
    layers."""
    out = run_interpreted(MODEL_CHECK)
    depths, errors = out["depths"], out["errors"]
    assert depths["naive"] == [] and depths["naive-docs"] == [], depths
    assert depths == out["planned"], out["planned"]
    for name in ("auto", "auto-docs"):
        assert depths[name] == [1, 2, 1, 2], (name, depths[name])
        assert errors[name][0] < 1e-12 and max(errors[name][1:]) <= 0, (name, errors[name])
    # linear alignment: the kernel runs layers 1 and 4, right after full layers (over two key heads per
    # group, or on mixed queries, groups of one, where one key head serves the group), and layer 2
    # in two stages, the first one's features as its source
    for name, first in (("linear-auto", 2), ("linear-gqa-auto", 1)):
        assert depths[name] == [1, 2, 1] and depths[name.replace("auto", "naive")] == [], depths
        assert out["groups"][name] == [first, 2, first], out["groups"]
        assert errors[name][0] < 1e-12 and max(errors[name][1:]) <= 0, (name, errors[name])
    assert out["shared_queries"]  # the chain's second layer keeps no copy of them
