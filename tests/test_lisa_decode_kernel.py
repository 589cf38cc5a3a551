"""The fused LISA decode kernel (models.attention.kernels.lisa_decode_triton) under Triton's
interpreter on CPU, against the PyTorch path it replaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.dist_utils import REPO

KERNEL_CHECK = """
import json, math, sys
import torch
from models.attention.kernels.lisa_decode_triton import lisa_decode
from models.attention.lisa import HeadAlign
from models.attention.relu import relu_normaliser, relu_weights
from models.attention.shared_scores import grouped_matmul
from tests.dist_utils import single_process_group

errors = {}
with single_process_group():
    for family, heads, kv_heads, group, hidden, rank, dv, keys, dtype in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(0)
        source = torch.randn(2, heads, 1, keys, generator=gen, dtype=dtype)
        qr = torch.randn(2, heads, 1, rank, generator=gen, dtype=dtype) / math.sqrt(rank)
        kr = torch.randn(2, heads, keys, rank, generator=gen, dtype=dtype)
        v = torch.randn(2, kv_heads, keys + 5, dv, generator=gen, dtype=dtype)[:, :, :keys]  # a cache view
        align = HeadAlign(heads, heads, group, hidden).to(dtype)
        with torch.no_grad():
            for p in align.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.5)
            scores = align(source) + qr @ kr.transpose(-2, -1)
            if family == "softmax":
                weights, normaliser = torch.softmax(scores, -1), None
            else:
                weights = relu_weights(scores, family)
                normaliser = relu_normaliser(family, 1, keys, source.device, keys - 1)
            ref = grouped_matmul(weights, v)
            ffn = (align.w1, align.b1, align.w2, align.b2) if hidden else None
            out, stored = lisa_decode(source, qr, kr, v, align.mix, ffn, normaliser, store_scores=True)
            bare, none = lisa_decode(source, qr, kr, v, align.mix, ffn, normaliser)
        assert none is None and out.dtype == dtype and out.shape == ref.shape
        key = f"{family}/{heads}/{kv_heads}/{group}/{hidden}/{rank}/{dv}/{keys}/{dtype}"
        errors[key] = [float((a - b).abs().max() / b.abs().max()) for a, b in
                       ((out, ref), (stored, scores), (bare, ref))]
print(json.dumps(errors))
"""

MODEL_CHECK = """
import json
import torch
import models.attention.kernels.lisa_decode_triton as fused
from models.attention.kv_cache import KVCache
from tests.dist_utils import single_process_group
from tests.test_attention import build, small_cfg

calls = []
kernel = fused.lisa_decode
fused.lisa_decode = lambda *a, **k: calls.append(k["store_scores"]) or kernel(*a, **k)
errors = {}
with single_process_group():
    for align_hidden in (16, 0):
        cfg = small_cfg("sslkklrrll", num_kv_heads=2)
        cfg.relu_attention.normalizer, cfg.lisa.align_hidden = "content", align_hidden
        model = build(cfg).double().eval()
        tokens = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            full = model.logits(tokens)
            cache = KVCache()
            parts = [model.logits(tokens[:, :8], {"kv_cache": cache})]
            before = len(calls)
            parts += [model.logits(tokens[:, i:i + 1], {"kv_cache": cache}) for i in range(8, 14)]
        errors[align_hidden] = float((torch.cat(parts, 1) - full).abs().max())
        errors[f"calls {align_hidden}"] = calls[before:before + 4]
print(json.dumps(errors))
"""


def run_interpreted(script: str, *args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_lisa_decode_equals_pytorch_path_under_interpreter():
    """Softmax and every ReLU normaliser; FFN and linear alignment; grouped-query values and plain
    heads; sizes that are not powers of two (a group of 3, rank 6, head_dim 12) and keys that are
    not a multiple of the key block (37, 5 against blocks of 16, split into chunks that are merged);
    float64 and float32; the aligned row it stores for a following LISA layer."""
    cases = [["softmax", 4, 2, 2, 16, 8, 16, 37, "float64"], ["softmax", 4, 4, 4, 0, 8, 16, 37, "float64"],
             ["softmax", 6, 2, 3, 5, 6, 12, 5, "float64"], ["softmax", 4, 1, 4, 16, 8, 32, 70, "float32"]]
    cases += [[n, 4, 2, 2, 16, 8, 16, 37, "float64"] for n in ("none", "prefix", "content", "seqlen")]
    cases += [["prefix", 6, 3, 3, 0, 6, 12, 21, "float64"]]
    errors = run_interpreted(KERNEL_CHECK, json.dumps(cases))
    assert len(errors) == len(cases)
    for case, errs in errors.items():
        tolerance = 1e-5 if case.endswith("float32") else 1e-12
        assert max(errs) < tolerance, (case, errs)


def test_model_decodes_through_fused_lisa_kernel_as_full_forward():
    """A model with every source kind and a LISA chain (sslkklrrll, grouped-query heads) decodes token
    by token through the fused kernel (four LISA layers per step, the one feeding the next LISA
    layer storing its row) and gives the logits of one full forward (float64)."""
    errors = run_interpreted(MODEL_CHECK)
    for hidden in ("16", "0"):
        assert errors[hidden] < 1e-10, errors
        assert errors[f"calls {hidden}"] == [False, False, True, False], errors  # layers 2, 5, 8 (stores), 9
