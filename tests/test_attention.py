"""Attention kinds: causality, references, LISA sharing and sizes, tensor-parallel equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.base import scaled_scores
from models.attention.lisa import LISAConfig
from models.attention.relu import relu_attention
from models.attention.sink import sink_softmax_attention, sink_softmax_weights
from models.attention.softmax import causal_softmax, softmax_attention
from models.config import ModelConfig
from models.registry import validate_model
from tests.dist_utils import REPO, single_process_group, spawn

VOCAB = 128


def small_cfg(attention: str, **extra) -> ModelConfig:
    num_layers = len(attention) if len(attention) > 1 else 2
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_layers=num_layers, ffn_hidden_size=96,
                      max_seq_len=24, attention=attention, vocab_pad_to=64,
                      lisa=LISAConfig(align_group=2, keep_full_layers=1), **extra)
    cfg.relu_attention.block_size = 5  # several query blocks at seq 24
    return cfg


@pytest.fixture(scope="module")
def single_process():
    """Megatron parallel state for one gloo process inside pytest (TP = 1)."""
    with single_process_group():
        yield


def full_values(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full-size tensor, following the parameter's TP partitioning."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, rank = param.partition_dim, ps.get_tensor_model_parallel_rank()
    size = param.shape[dim]
    return full.narrow(dim, rank * size, size)


def perturb_lisa(model, cfg: ModelConfig, seed: int = 7) -> None:
    """Give the zero-initialised LISA pieces (key correction, FFN output) TP-independent values."""
    from models.attention.lisa import LISAAttention

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            if isinstance(attn, LISAAttention):
                pieces = [(attn.qk.weight, (2 * cfg.num_heads * attn.rank, cfg.hidden_size))]
                if attn.align.hidden:
                    pieces.append((attn.align.w2, (cfg.num_heads // attn.align.group, attn.align.group,
                                                   cfg.lisa.align_hidden)))
                for param, full_shape in pieces:
                    full = torch.randn(full_shape, generator=gen) * 0.3
                    param.copy_(full_values(param, full))


def build(cfg: ModelConfig, seed: int = 0):
    from models.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(cfg)
    perturb_lisa(model, cfg)
    return model


def ffn_chain_model(kernel: str, keep_chain_scores: bool):
    """slllrll in float64 for the fused LISA kernels' tests: LISA chains of three after a softmax layer
    and of two after a relu layer (the PyTorch path), grouped-query heads, FFN alignment in groups of
    2, blocks of 5 query rows, the FFN's weights large enough to matter."""
    cfg = small_cfg("slllrll", num_kv_heads=2)
    cfg.relu_attention.kernel = "torch"
    cfg.lisa.align_hidden, cfg.lisa.kernel, cfg.lisa.block_size = 16, kernel, 5
    cfg.lisa.keep_chain_scores = keep_chain_scores
    model = build(cfg).double().train()
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.attn, "align"):
                block.attn.align.w2.normal_(std=0.3, generator=torch.Generator().manual_seed(4))
                block.attn.align.b1.normal_(generator=torch.Generator().manual_seed(5))
    return model


def linear_mixing_model(kernel: str, kv_heads: int = 0):
    """sllrl in float64: linear alignment in groups of 2 heads, the mixing weights random. Without
    grouped-query heads each group reads two key heads; with kv_heads=2 one key head serves each
    group (both run by the fused LISA kernel on a GPU right after a full layer)."""
    cfg = small_cfg("sllrl", num_kv_heads=kv_heads)
    cfg.relu_attention.kernel, cfg.relu_attention.normalizer = "torch", "content"
    cfg.lisa.align_hidden, cfg.lisa.kernel = 0, kernel
    model = build(cfg).double().train()
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.attn, "align"):
                block.attn.align.mix.normal_(generator=torch.Generator().manual_seed(4))
    return model


# --- cores against references (no process group needed) -------------------------------------------

def naive_relu(q, k, v, normalizer):
    b, h, s, d = q.shape
    out = torch.zeros_like(v)
    for i in range(s):
        n = {"none": 1.0, "prefix": float(i + 1), "content": float(max(i, 1)), "seqlen": float(s)}[normalizer]
        for j in range(i + 1):
            w = torch.relu((q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(d)) / n
            out[:, :, i] += w.unsqueeze(-1) * v[:, :, j]
    return out


@pytest.mark.parametrize("normalizer", ["none", "prefix", "content", "seqlen"])
def test_relu_matches_naive_reference_with_grads(normalizer):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, 11, 8, generator=gen, dtype=torch.float64)
    ref = naive_relu(q, k, v, normalizer)
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for block in (1, 4, 11, 64):
        out = relu_attention(q, k, v, normalizer, block)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad((out * g).sum(), (q, k, v))
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


TRITON_CHECK = """
import json, sys
import torch
from models.attention.kernels.relu_triton import supports, triton_relu_attention
from models.attention.relu import relu_weights
from tests.test_attention import naive_relu
errors = {}
for normalizer, kv_heads, dim, v_dim, docs in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 37, d, generator=gen, requires_grad=True) for d in (dim, v_dim))
    g = torch.randn(2, 4, 37, v_dim, generator=gen)
    assert supports(q, v) and not supports(q, v[..., :12])
    documents = None
    if docs:  # documents of 3, 14, 20 positions; 21, 16 (blocks of 16: skipped blocks, a document across blocks)
        documents = torch.zeros(2, 37, dtype=torch.long)
        documents[0, 3:] += 1
        documents[0, 17:] += 1
        documents[1, 21:] += 1
    out = triton_relu_attention(q, k, v, normalizer, documents=documents)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(4 // kv_heads, 1) for t in (kd, vd))
    if docs:
        ref = relu_weights(qd @ kr.transpose(-2, -1) / dim ** 0.5, normalizer, documents) @ vr
    else:
        ref = naive_relu(qd, kr, vr, normalizer)
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), (qd, kd, vd))
    errors[f"{normalizer}/{kv_heads}/{dim}/{v_dim}/{docs}"] = [
        float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip((out, *grads), (ref, *ref_grads))]
print(json.dumps(errors))
"""


def test_triton_relu_kernels_are_not_given_float64_on_a_gpu(monkeypatch):
    """Their fp32 accumulators take no fp64 products (Triton refuses to compile them): a float64
    model on a GPU, such as the GPU check's reference, keeps the PyTorch path."""
    from types import SimpleNamespace

    from models.attention.kernels import relu_triton

    monkeypatch.setattr(relu_triton, "triton_interpreted", lambda: False)
    v = SimpleNamespace(shape=(1, 4, 64, 64))
    for dtype, runs in ((torch.float64, False), (torch.float32, True), (torch.bfloat16, True)):
        q = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 4, 64, 64))
        assert relu_triton.supports(q, v) is runs, dtype


def test_triton_relu_kernels_match_naive_reference_under_interpreter():
    """The fused kernels (forward, dQ, dK/dV) under TRITON_INTERPRET=1 on CPU: every normaliser,
    grouped-query (2 K/V heads for 4) and plain heads, a sequence that is not a multiple of the
    block (37 against blocks of 16), queries and keys wider than the values and not a power of two
    (24 against 16, as LISA's score features), within documents."""
    import json
    import os
    import subprocess
    import sys

    from tests.dist_utils import REPO

    cases = [[n, 2, 16, 16, False] for n in ("none", "prefix", "content", "seqlen")]
    cases += [["prefix", 4, 32, 32, False], ["content", 2, 24, 16, False]]
    cases += [[n, 2, 16, 16, True] for n in ("prefix", "content", "seqlen")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == len(cases)
    for case, (out, dq, dk, dv) in errors.items():
        assert max(out, dq, dk, dv) < 1e-5, (case, out, dq, dk, dv)  # fp32 kernels vs float64 reference


def test_softmax_matches_explicit_reference():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = softmax_attention(q, k, v)
    ref = torch.zeros_like(v)
    for i in range(9):
        s = (q[:, :, i:i + 1] @ k[:, :, : i + 1].transpose(-2, -1)).squeeze(-2) / math.sqrt(8)
        ref[:, :, i] = (s.exp() / s.exp().sum(-1, keepdim=True)).unsqueeze(-2).matmul(v[:, :, : i + 1]).squeeze(-2)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(causal_softmax(scaled_scores(q, k)) @ v, ref)


def test_sink_softmax_matches_formula_and_fast_path():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sink = torch.tensor([-1.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    weights = sink_softmax_weights(scaled_scores(q, k), sink)
    s = scaled_scores(q, k)
    for i in range(7):  # p_ij = e^s_ij / (e^b_h + sum_j' e^s_ij')
        denom = sink.exp().view(1, 3) + s[:, :, i, : i + 1].exp().sum(-1)
        torch.testing.assert_close(weights[:, :, i, : i + 1], s[:, :, i, : i + 1].exp() / denom.unsqueeze(-1))
        assert torch.all(weights[:, :, i, i + 1:] == 0)
    explicit = weights @ v
    fast = sink_softmax_attention(q, k, v, sink)
    torch.testing.assert_close(fast, explicit)
    g1 = torch.autograd.grad(fast.sum(), (q, k, v, sink))
    g2 = torch.autograd.grad(explicit.sum(), (q, k, v, sink))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


# --- whole models, one process ----------------------------------------------------------------------

PATTERNS = ["s", "k", "r", "sl", "rl", "kll"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_no_information_from_future_tokens(single_process, pattern):
    cfg = small_cfg(pattern)
    model = build(cfg).double()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    for capture in (False, True):  # fast kernels and the explicit (published / captured) path
        base = model.logits(tokens, {"capture_attention": capture})
        for t in (0, 9, 22):
            changed = tokens.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
            out = model.logits(changed, {"capture_attention": capture})
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-12)
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])


@pytest.mark.parametrize("pattern", ["s", "k", "r"])
def test_capture_does_not_change_outputs(single_process, pattern):
    cfg = small_cfg(pattern)
    model = build(cfg).double()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    ctx = {"capture_attention": True}
    torch.testing.assert_close(model.logits(tokens, ctx), model.logits(tokens))
    assert sorted(ctx["attention_maps"]) == [0, 1]


def test_a_source_layer_that_publishes_nothing_is_named(single_process):
    """A kind that says LISA may read its scores (score_family) but whose core hands none on."""
    from models.attention.softmax import softmax_attention

    model = build(small_cfg("sl"))
    source = model.blocks[0].attn
    assert source.publish_scores
    source.core = lambda q, k, v, ctx: softmax_attention(q, k, v)  # attends, publishes nothing
    with pytest.raises(RuntimeError, match=r"layer 0 \(SoftmaxAttention\) is to hand its attention scores"):
        model.logits(torch.randint(0, VOCAB, (1, 8)))


@pytest.mark.parametrize("align_hidden", [16, 0])  # explicit scores; score features
def test_lisa_with_activation_checkpointing_matches(single_process, align_hidden):
    """Scores handed across checkpointed blocks (full) or around recomputed attention cores
    (selective) through ctx, and LISA scores built by query blocks: same loss and grads as one plain
    pass, for softmax_sink, relu, softmax and LISA layers."""
    from models.gpt import GPT

    cfg = small_cfg("krlsl")
    cfg.lisa.align_hidden = align_hidden
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    grads = []
    saved = {}
    for ckpt, row_block in (("none", 256), ("full", 7), ("selective", 7)):
        cfg.lisa.block_size = row_block
        torch.manual_seed(0)
        model = GPT(cfg, activation_checkpointing=ckpt).double().train()
        perturb_lisa(model, cfg)
        with torch.no_grad():
            for block in model.blocks:
                if getattr(getattr(block.attn, "align", None), "hidden", 0):
                    block.attn.align.b1.normal_()
        kept = []  # bytes autograd keeps for backward (recomputed regions keep nothing here)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        saved[ckpt] = sum(kept)
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert saved["full"] < saved["selective"] < saved["none"], saved
    for other in grads[1:]:
        torch.testing.assert_close(other[0], grads[0][0])
        for name, g in grads[0][1].items():
            torch.testing.assert_close(other[1][name], g, msg=name)


@pytest.mark.parametrize("source", ["s", "r"])
def test_lisa_identity_alignment_reproduces_previous_weights(single_process, source):
    from models.attention.lisa import LISAAttention

    cfg = small_cfg(source + "l")
    torch.manual_seed(0)
    from models.gpt import GPT

    model = GPT(cfg).double()
    lisa = model.blocks[1].attn
    assert isinstance(lisa, LISAAttention) and model.blocks[0].attn.publish_scores
    with torch.no_grad():
        lisa.qk.weight.zero_()
        lisa.align.w1.normal_()  # the FFN's hidden layer is live, only its output weight is zero
        assert torch.equal(lisa.align.mix, torch.eye(2).expand_as(lisa.align.mix))
    ctx = {"capture_attention": True}
    model.logits(torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5)), ctx)
    maps = ctx["attention_maps"]
    torch.testing.assert_close(maps[1], maps[0], rtol=0, atol=1e-14)
    with torch.no_grad():  # a head permutation is representable too: swap heads within each group
        lisa.align.mix.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]).expand_as(lisa.align.mix))
    ctx = {"capture_attention": True}
    model.logits(torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5)), ctx)
    maps = ctx["attention_maps"]
    torch.testing.assert_close(maps[1], maps[0][:, [1, 0, 3, 2]], rtol=0, atol=1e-14)


@pytest.mark.parametrize("source", ["s", "k", "r"])
@pytest.mark.parametrize("kv_heads,group", [(0, 2), (2, 2), (2, 4)])  # per-head keys, mixed queries, keys side by side
def test_lisa_score_features_equal_explicit_scores(single_process, source, kv_heads, group):
    """Linear alignment over score features (kernel auto) against the explicit-scores reference,
    along a chain of two LISA layers: logits and every gradient, float64; the planner's feature
    width is each layer's."""
    from models.attention.lisa import feature_width
    from models.attention.masks import document_ids
    from models.attention.shared_scores import SharedScores

    documents = kv_heads == 2 and group == 4
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    if documents:
        tokens[0, [6, 15]] = tokens[1, 10] = 0  # EOS = 0
    results, published = [], None
    for kernel in ("auto", "naive"):
        cfg = small_cfg(source + "ll", num_kv_heads=kv_heads)
        cfg.relu_attention.normalizer = "content"
        cfg.lisa.align_hidden, cfg.lisa.align_group, cfg.lisa.kernel = 0, group, kernel
        model = build(cfg).double()
        with torch.no_grad():  # non-trivial head mixing
            for block in model.blocks[1:]:
                block.attn.align.mix.copy_(torch.randn(block.attn.align.mix.shape,
                                                       generator=torch.Generator().manual_seed(4)))
        model.blocks[2].attn.publish_scores = True  # the chain's last features, for their width
        ctx = {"document_ids": document_ids(tokens, 0)} if documents else {}
        logits = model.logits(tokens, ctx)
        logits.square().sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
        published = published or ctx["attention_scores"]
    assert all(isinstance(published[layer], SharedScores) for layer in (0, 1, 2))  # no seq^2 scores built
    assert [published[1].width, published[2].width] == [feature_width(cfg, 1), feature_width(cfg, 2)]
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    for name, g in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], g, rtol=1e-9, atol=1e-10, msg=name)


def test_head_alignment_in_pieces_equals_pointwise_formula(single_process, monkeypatch):
    """HeadAlign against the formula at every (query, key): within each group of g heads,
    S_hat = M S + W2 GELU(W1 S + b1) + b2, with its FFN over row blocks of 3 rows and pieces of 20
    scores (so pieces split rows, and row blocks end mid-piece): outputs and gradients (float64)."""
    import torch.nn.functional as F

    from models.attention import lisa

    monkeypatch.setattr(lisa, "HIDDEN_PIECE_BYTES", 2 * 2 * 5 * 8 * 20)  # batch x groups x hidden x 8 bytes x 20
    align = lisa.HeadAlign(num_heads=4, local_heads=4, group=2, hidden=5, row_block=3).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in align.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
    scores = torch.randn(2, 4, 7, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    out = align(scores)

    s = scores.view(2, 2, 2, 7, 9).permute(0, 1, 3, 4, 2)  # [batch, group, q, k, head in group]
    hidden = F.gelu(torch.einsum("bnijg,nkg->bnijk", s, align.w1) + align.b1[:, None, None])
    ref = (torch.einsum("bnijg,nhg->bnijh", s, align.mix) + torch.einsum("bnijk,ngk->bnijg", hidden, align.w2)
           + align.b2[:, None, None])
    ref = ref.permute(0, 1, 4, 2, 3).reshape(2, 4, 7, 9)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), [scores, *align.parameters()])
    ref_grads = torch.autograd.grad((ref * weights).sum(), [scores, *align.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("source,normalizer,documents", [("s", "prefix", False), ("k", "prefix", True),
                                                        ("r", "content", False), ("r", "prefix", True),
                                                        ("r", "seqlen", True)])
def test_lisa_ffn_alignment_by_query_blocks_equals_explicit_scores(single_process, monkeypatch, source, normalizer,
                                                                  documents):
    """The FFN alignment built 5 query rows at a time (kernel auto, seq 24), along a chain of two
    LISA layers, against the explicit scores: logits and every gradient (float64). The fast path
    builds no [seq, seq] scores, only row blocks, and its LISA layers keep no [seq, seq] tensor for
    backward; the reference keeps several."""
    from models.attention.lisa import LISAAttention
    from models.attention.masks import document_ids
    from models.attention.shared_scores import SharedScores

    block_shapes = []
    rows, materialize = SharedScores.rows, SharedScores.materialize
    monkeypatch.setattr(SharedScores, "rows", lambda self, *a: block_shapes.append(rows(self, *a).shape[-2:])
                        or rows(self, *a))
    monkeypatch.setattr(SharedScores, "materialize", lambda self: block_shapes.append("all") or materialize(self))

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    if documents:
        tokens[0, [6, 15]] = tokens[1, 10] = 0  # EOS = 0
    results, square = [], {}
    for kernel in ("auto", "naive"):
        cfg = small_cfg(source + "ll", num_kv_heads=2 if documents else 0)
        cfg.relu_attention.normalizer = normalizer
        cfg.lisa.kernel, cfg.lisa.block_size = kernel, 5
        model = build(cfg).double()
        inside, kept = [], []
        with torch.no_grad():
            for block in model.blocks[1:]:
                block.attn.align.b1.normal_(generator=torch.Generator().manual_seed(4))
                block.attn.align.mix.add_(0.5)  # heads mixed in the linear part too
                block.attn.register_forward_pre_hook(lambda *_: inside.append(1))
                block.attn.register_forward_hook(lambda *_: inside.clear())  # returns None: output kept
        assert all(isinstance(b.attn, LISAAttention) for b in model.blocks[1:])
        ctx = {"document_ids": document_ids(tokens, 0)} if documents else {}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(inside and t.shape[-2:]) or t,
                                                      lambda t: t):
            logits = model.logits(tokens, ctx)
        logits.square().sum().backward()
        square[kernel] = sum(shape == (24, 24) for shape in kept if shape)
        if kernel == "auto":  # forward and backward recompute: blocks of 5 rows over the keys up to them
            assert block_shapes and all(shape != "all" and shape[0] <= 5 for shape in block_shapes), block_shapes
            assert {tuple(shape) for shape in block_shapes} >= {(5, 5), (5, 10), (4, 24)}
        else:
            assert block_shapes[-1] == "all"
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert square["auto"] == 0 and square["naive"] > 0, square
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    for name, g in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], g, rtol=1e-9, atol=1e-10, msg=name)


def test_lisa_chain_keeps_scores_instead_of_rebuilding(single_process, monkeypatch):
    """model.lisa.keep_chain_scores along a chain of three FFN-aligned LISA layers (blocks of 5 rows
    at seq 24): each layer aligns each of its blocks once (5 x 3) where rebuilding aligns the chain's
    earlier layers again (5 x (1 + 2 + 3)); loss and every gradient equal rebuilding and the explicit
    scores (float64), also under full activation checkpointing; the kept rows are the bytes the
    planner counts (lisa_handed_on); rows cut across kept blocks equal the explicit scores' rows."""
    from models.attention.lisa import HeadAlign, KeptRows, lisa_handed_on
    from models.gpt import GPT
    from models.registry import ActivationLayout

    aligned = []
    nonlinear = HeadAlign.nonlinear
    monkeypatch.setattr(HeadAlign, "nonlinear",
                        lambda self, s: aligned.append(s.shape[-2]) or nonlinear(self, s))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    results, kept_bytes = {}, {}
    for name, kernel, keep, ckpt in (("rebuild", "auto", False, "none"), ("keep", "auto", True, "none"),
                                     ("keep-full", "auto", True, "full"), ("naive", "naive", False, "none")):
        cfg = small_cfg("slllr")
        cfg.lisa.kernel, cfg.lisa.block_size, cfg.lisa.keep_chain_scores = kernel, 5, keep
        torch.manual_seed(0)
        model = GPT(cfg, activation_checkpointing=ckpt).double().train()
        perturb_lisa(model, cfg)
        with torch.no_grad():
            for block in model.blocks[1:4]:
                block.attn.align.b1.normal_(generator=torch.Generator().manual_seed(4))
        if name in ("rebuild", "keep"):
            aligned.clear()
            with torch.no_grad():
                ctx = {}
                model.logits(tokens, ctx)
            assert aligned and all(rows <= 5 for rows in aligned), aligned
            assert len(aligned) == {"rebuild": 5 * 6, "keep": 5 * 3}[name], (name, len(aligned))
            kept = [scores for layer, scores in ctx["attention_scores"].items() if layer in (1, 2)]
            assert all(isinstance(scores, KeptRows) == keep for scores in kept), kept
            kept_bytes[name] = sum(b.numel() * b.element_size()
                                   for scores in kept if keep for _, b in scores.blocks)
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    ref_loss, ref_grads = results["naive"]
    for name in ("rebuild", "keep", "keep-full"):
        torch.testing.assert_close(results[name][0], ref_loss, rtol=1e-12, atol=1e-12)
        for param, g in ref_grads.items():
            torch.testing.assert_close(results[name][1][param], g, rtol=1e-9, atol=1e-10,
                                       msg=f"{name} {param}")

    cfg.lisa.kernel, cfg.lisa.keep_chain_scores = "auto", True
    layout = ActivationLayout(tensor=1, seq=24, flash=False, selective=False)
    per_token = lisa_handed_on(cfg, layout) * 3  # the mean over the three LISA layers
    assert kept_bytes["keep"] == per_token * tokens.numel() * 8 and kept_bytes["rebuild"] == 0, kept_bytes

    explicit = torch.randn(2, 4, 24, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rows = KeptRows([(start, explicit[..., start:start + 5, :start + 5]) for start in range(0, 24, 5)])
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    for start, end in ((0, 5), (5, 10), (3, 13), (0, 24), (20, 24)):
        got = rows.rows(start, end)
        mask = causal[start:end, :end]
        assert got.shape == (2, 4, end - start, end)
        torch.testing.assert_close(got * mask, explicit[..., start:end, :end] * mask, rtol=0, atol=0)


@pytest.mark.parametrize("align_hidden", [16, 0])  # LISA on explicit scores; on score features
def test_kv_cache_decoding_equals_recomputing(single_process, align_hidden):
    """Every kind with grouped-query attention, each source kind once feeding a LISA layer and once
    not, and a LISA chain: a prompt, then tokens one at a time, then a chunk, through the KV cache
    give the logits of one full forward (float64), and so does another continuation through a copy
    of the prefilled cache, without touching the first; greedy generation with the cache equals
    generation without, also past max_seq_len. Decoding one token, the layers before LISA layers
    hand on their explicit new score rows."""
    from models.attention.kv_cache import KVCache
    from models.attention.lisa import LISAAttention
    from models.generation import generate

    cfg = small_cfg("sslkklrrll", num_kv_heads=2)
    cfg.relu_attention.normalizer, cfg.lisa.align_hidden = "content", align_hidden
    cfg.lisa.block_size = 3  # the prefill builds FFN-aligned scores in several blocks
    model = build(cfg).double().eval()
    with torch.no_grad():
        for block in model.blocks:
            if isinstance(block.attn, LISAAttention):
                block.attn.align.mix.copy_(torch.randn(block.attn.align.mix.shape,
                                                       generator=torch.Generator().manual_seed(4)))
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model.logits(tokens)
        cache = KVCache()
        parts = [model.logits(tokens[:, :8], {"kv_cache": cache})]
        step = {"kv_cache": cache}
        parts.append(model.logits(tokens[:, 8:9], step))  # the buffers grow
        assert sorted(step["attention_scores"]) == [1, 4, 7, 8]
        assert all(isinstance(s, torch.Tensor) and s.shape == (2, 4, 1, 9) for s in step["attention_scores"].values())
        fork, other = cache.copy(), tokens[:, 12:15].flip(0)
        parts += [model.logits(tokens[:, i:i + 1], {"kv_cache": cache}) for i in range(9, 12)]  # in place
        forked = [model.logits(other[:, i:i + 1], {"kv_cache": fork}) for i in range(3)]
        parts.append(model.logits(tokens[:, 12:], {"kv_cache": cache}))  # reads what the fork must not write
        other_full = model.logits(torch.cat([tokens[:, :9], other], 1))[:, 9:]
    assert cache.length == 20 and fork.length == 12
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(forked, 1), other_full, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="start a new KVCache"), torch.no_grad():  # another batch size
        model.logits(tokens[:1, 12:13], {"kv_cache": fork})
    prompt = tokens[0, :5].tolist()
    head_rows = []  # the output layer runs on the last position of each forward only
    hook = model.head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[1]))
    cached = generate(model, prompt, 25, greedy=True)
    assert cached == generate(model, prompt, 25, greedy=True, use_cache=False) and len(set(cached)) > 3
    hook.remove()
    assert head_rows == [1] * 50
    with torch.no_grad():  # both: a plain greedy loop over the last max_seq_len tokens (30 > 24)
        plain = list(prompt)
        for _ in range(25):
            plain.append(int(model.logits(torch.tensor([plain[-cfg.max_seq_len:]]))[0, -1, :VOCAB].argmax()))
    assert cached == plain[len(prompt):]
    # Padding ids of the head (vocab_pad_to) are never drawn, however high their logits.
    own = model.output_logits
    model.output_logits = lambda hidden: torch.cat([own(hidden), torch.full((*own(hidden).shape[:-1], 64), 1e9,
                                                                              dtype=torch.float64)], -1)
    assert generate(model, prompt, 3, greedy=True) == cached[:3]
    assert max(generate(model, prompt, 3, generator=torch.Generator().manual_seed(0))) < VOCAB


def test_planner_counts_kept_chain_rows_only_where_the_fused_kernel_does_not_run():
    """On a GPU (ActivationLayout.flash) the fused LISA kernel runs a chain's first two layers and
    keeps no rows: of a chain of four FFN-aligned LISA layers only the third keeps its rows (for the
    fourth); off the GPU the first three do; with groups over four heads, the kernel never runs."""
    from models.attention.lisa import kept_rows_per_token, lisa_handed_on
    from models.registry import ActivationLayout

    cfg = small_cfg("sllll")
    cfg.lisa.kernel, cfg.lisa.keep_chain_scores, cfg.lisa.align_group = "auto", True, 2
    rows = cfg.num_heads * kept_rows_per_token(24, cfg.lisa.block_size)
    gpu = ActivationLayout(tensor=1, seq=24, flash=True, selective=False)
    cpu = ActivationLayout(tensor=1, seq=24, flash=False, selective=False)
    # the planner's mean over the four LISA layers, times four
    assert 4 * lisa_handed_on(cfg, cpu) == 3 * rows and 4 * lisa_handed_on(cfg, gpu) == 1 * rows
    wide = small_cfg("sllll")
    wide.num_heads, wide.lisa.kernel, wide.lisa.keep_chain_scores, wide.lisa.align_group = 8, "auto", True, 8
    assert lisa_handed_on(wide, gpu) == lisa_handed_on(wide, cpu) > 0


def test_lisa_score_flops_count_its_own_products():
    """A LISA layer's training FLOPs per token beyond its parameters: its rank-r products, the
    alignment (mixing, FFN) and the values, not a softmax layer's full-width products (at the 1B
    hybrid's sizes 0.70x those; at this tiny width the FFN alignment costs more than them)."""
    from models.attention.lisa import lisa_score_flops
    from models.counting import flops_per_token, param_counts
    from pretrain.config import load_config

    cfg = small_cfg("ssl")  # hidden 64, 4 heads; rank 2, groups of 2, FFN width 16
    s, d, heads, rank, group, hid = 24, 64, 4, 2, 2, 16
    # untied: the embedding is a lookup; the norms' weights multiply nothing
    matmul = param_counts(cfg)["total"] - cfg.padded_vocab_size * d - (2 * cfg.num_layers + 1) * d
    lisa = 3 * s * (heads * (2 * rank + 2 * group + 4 * hid) + 2 * d)
    assert flops_per_token(cfg, s) == 6 * matmul + 2 * 12 * d * s + lisa
    hybrid = load_config(str(REPO / "configs/hybrid_1b.yaml")).model
    assert lisa_score_flops(hybrid, 2048) / (12 * hybrid.hidden_size * 2048) == pytest.approx(5760 / 8192)


def test_lisa_qk_compression_and_exact_param_count(single_process):
    from models.attention.lisa import lisa_param_count, qk_compression
    from models.counting import param_counts

    for hidden, heads in ((64, 4), (128, 4), (768, 12), (2048, 16)):
        cfg = ModelConfig(hidden_size=hidden, num_heads=heads)
        assert qk_compression(cfg) >= 6.0, (hidden, heads)
        r = cfg.lisa.resolved_rank(cfg.head_dim)
        assert 2 * hidden * hidden >= 6 * 2 * hidden * heads * r
    cfg = small_cfg("kslrl")
    model = build(cfg)
    lisa = model.blocks[2].attn
    assert sum(p.numel() for p in lisa.parameters()) == lisa_param_count(cfg)
    qk_lisa = lisa.qk.weight.numel()
    qk_full = 2 * cfg.hidden_size ** 2
    assert qk_full / qk_lisa == qk_compression(cfg) >= 6
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]
    cfg.lisa.align_hidden = 0  # linear head mixing only
    model = build(cfg)
    assert model.logits(torch.randint(0, VOCAB, (1, 24))).isfinite().all()
    assert sum(p.numel() for p in model.blocks[2].attn.parameters()) == lisa_param_count(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]


def test_lisa_placement_is_validated():
    cfg = ModelConfig(num_layers=4, attention="ssll", lisa=LISAConfig(keep_full_layers=3))
    with pytest.raises(ValueError, match="keep_full_layers"):
        validate_model(cfg)
    cfg = ModelConfig(num_layers=2, attention="ls", lisa=LISAConfig(keep_full_layers=0))
    with pytest.raises(ValueError, match="layer 0 is lisa"):
        validate_model(cfg)
    cfg = ModelConfig(num_layers=3, attention="srl", num_heads=4, lisa=LISAConfig(align_group=3, keep_full_layers=1))
    with pytest.raises(ValueError, match="align_group"):
        validate_model(cfg)
    validate_model(ModelConfig(num_layers=4, attention="ssll"))  # default keep_full_layers=2


# --- grouped-query attention ---------------------------------------------------------------------------

def mha_state_from_gqa(state: dict, cfg: ModelConfig) -> dict:
    """A grouped-query model's weights as multi-head weights: each K/V head repeated for its group."""
    h, kv, hd, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    g = h // kv
    out = dict(state)
    for name, w in state.items():
        if name.endswith("attn.qkv.weight"):
            grouped = w.view(kv, g + 2, hd, d)
            q = grouped[:, :g].reshape(h, hd, d)
            k, v = (grouped[:, i].repeat_interleave(g, 0) for i in (g, g + 1))
            out[name] = torch.stack([q, k, v], dim=1).reshape(3 * h * hd, d)
        elif name.endswith("attn.v.weight"):  # LISA
            out[name] = w.view(kv, hd, d).repeat_interleave(g, 0).reshape(h * hd, d)
    return out


@pytest.mark.parametrize("capture", [False, True])
def test_grouped_query_attention_equals_repeated_kv_heads(single_process, capture):
    """4 query heads on 2 K/V heads give the logits of 4-head attention whose K/V heads are the
    grouped ones repeated, for every attention kind, on the fast kernels and the explicit path."""
    from models.counting import param_counts

    gqa_cfg, mha_cfg = small_cfg("kslrl", num_kv_heads=2), small_cfg("kslrl")
    gqa = build(gqa_cfg).double()
    mha = build(mha_cfg).double()
    mha.load_state_dict(mha_state_from_gqa(gqa.state_dict(), gqa_cfg))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(gqa.logits(tokens, {"capture_attention": capture}), mha.logits(tokens),
                               rtol=1e-10, atol=1e-12)
    n_gqa = sum(p.numel() for p in gqa.parameters())
    assert n_gqa == param_counts(gqa_cfg)["total"]
    # K/V halved (64 -> 32 wide) in the 3 qkv layers and the 2 LISA value projections.
    assert sum(p.numel() for p in mha.parameters()) - n_gqa == 64 * 32 * (2 * 3 + 2)


def test_convert_lisa_keeps_grouped_values(single_process):
    """Converting a grouped-query layer to LISA keeps its values: the new V projection gives the
    source layer's K/V-head values."""
    from models.attention.lisa_conversion import build_lisa_model, lisa_config

    cfg = small_cfg("ssss", num_kv_heads=2)
    source = build(cfg)
    new_cfg = lisa_config(cfg, [2])
    model = build_lisa_model(source, cfg, new_cfg, [2], sim={})
    x = torch.randn(2, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    _, _, v_source = source.blocks[2].attn.project(x, {"rotary": source.rotary})
    v_lisa, _ = model.blocks[2].attn.v(x)
    assert v_source.shape == (2, 2, 24, cfg.head_dim)
    torch.testing.assert_close(v_lisa.view(2, 24, 2, cfg.head_dim).transpose(1, 2), v_source, rtol=0, atol=0)


def test_grouped_query_heads_are_validated(single_process):
    from pretrain.config import ConfigError, load_config, validate

    with pytest.raises(ValueError, match="num_kv_heads=3 must divide model.num_heads=4"):
        validate_model(small_cfg("s", num_kv_heads=3))
    for overrides, match in ((["model.num_kv_heads=3"], "num_kv_heads=3 must divide model.num_heads=4"),
                             (["model.num_kv_heads=1", "parallel.tensor=2"],
                              "num_kv_heads=1 is not divisible by parallel.tensor=2")):
        with pytest.raises(ConfigError, match=match):
            validate(load_config(None, overrides), world_size=2)


# --- tensor parallel = 2 equals tensor parallel = 1 ------------------------------------------------

TP_PATTERN = "kslrl"


def outputs_and_grads(cfg: ModelConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full-vocabulary logits and full (TP-gathered) grads of a fixed loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = build(cfg).double()
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(6))
    local = model.logits(tokens)  # [batch, seq, padded_vocab / tp]
    # A fixed random linear read-out of the full logits: each rank sums its vocabulary shard's part,
    # and the column-parallel head all-reduces the input gradient, so grads are those of the total.
    readout = torch.randn(2, 24, cfg.padded_vocab_size, generator=torch.Generator().manual_seed(8),
                          dtype=torch.float64)
    width = local.shape[-1]
    (local * readout[..., rank * width:(rank + 1) * width]).sum().backward()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    logits = torch.cat(parts, dim=-1)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if world > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return logits.detach(), grads


def _tp_worker(rank: int, out_path: str, kv_heads: int) -> None:
    logits, grads = outputs_and_grads(tp_cfg(kv_heads))
    if rank == 0:
        torch.save({"logits": logits, "grads": grads}, out_path)


def tp_cfg(kv_heads: int) -> ModelConfig:
    """Grouped-query attention (one K/V head per rank) with the LISA layers' linear alignment,
    which attends over score features; multi-head with the FFN alignment, on explicit scores."""
    cfg = small_cfg(TP_PATTERN, num_kv_heads=kv_heads)
    cfg.lisa.align_hidden = 0 if kv_heads else cfg.lisa.align_hidden
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_tensor_parallel_2_equals_1(single_process, tmp_path, kv_heads):
    ref_logits, ref_grads = outputs_and_grads(tp_cfg(kv_heads))
    spawn(_tp_worker, 2, str(tmp_path / "tp2.pt"), kv_heads, tensor=2)
    tp2 = torch.load(tmp_path / "tp2.pt")
    torch.testing.assert_close(tp2["logits"], ref_logits, rtol=1e-9, atol=1e-10)
    assert tp2["grads"].keys() == ref_grads.keys()
    checked = 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(tp2["grads"][name], g, rtol=1e-8, atol=1e-10, msg=name)
        checked += bool(g.abs().sum() > 0)
    assert any("sink" in n for n in ref_grads) and any("align.w1" in n for n in ref_grads) != bool(kv_heads)
    assert checked >= len(ref_grads) - 1  # every parameter gets a gradient (all paths are live)


# --- converting trained layers to LISA ------------------------------------------------------------------

def permuted_source(cfg: ModelConfig, perm: list[int], pair_change: float = 0.0):
    """A float64 model whose layer 2 Q/K heads are layer 1's, head h of layer 2 = head perm[h] of
    layer 1 (distinct, well-separated heads), plus `pair_change` x random in one RoPE pair of
    every layer-2 query head (a rank-1 complex change per pair). Block 1 adds nothing to the
    residual stream, so both layers see the same input and their scores differ only by the weights."""
    model = build(cfg).double()
    h, hd, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        first = model.blocks[1].attn.qkv.weight.view(h, 3, hd, d)
        first[:, :2] = torch.randn(h, 2, hd, d, generator=gen, dtype=torch.float64) * 0.4
        second = model.blocks[2].attn.qkv.weight.view(h, 3, hd, d)
        second[:, :2] = first[perm, :2]
        model.blocks[1].attn.out.weight.zero_()
        model.blocks[1].mlp.w_out.weight.zero_()
        if pair_change:
            for row in (3, 3 + hd // 2):  # pair 3 of the half-split layout
                second[:, 0, row] += pair_change * torch.randn(h, d, generator=gen, dtype=torch.float64)
    return model


def converted(source, cfg, layers, qk_init, tokens):
    from models.attention.lisa_conversion import build_lisa_model, layer_similarity, lisa_config

    sim = layer_similarity(source, [tokens])
    return build_lisa_model(source, cfg, lisa_config(cfg, layers), layers, sim, qk_init), sim


def test_conversion_measures_a_model_within_documents_as_evaluate_does(single_process):
    """convert_lisa's losses (and so its sensitivity choice) of a run trained with
    data.document_mask attend within documents, as tools.evaluate and the trainer do."""
    from models.attention.lisa_conversion import layer_similarity
    from models.attention.masks import document_ids
    from tools.convert_lisa import val_loss
    from tools.evaluate import evaluate_rows

    model = build(small_cfg("ssss")).eval()
    rows = torch.randint(4, VOCAB, (4, 25), generator=torch.Generator().manual_seed(0))
    rows[:, 7], rows[:, 15] = 2, 2  # EOS: three documents a row
    within = val_loss(model, rows, 2, eos=2)
    assert within == pytest.approx(evaluate_rows(model, rows, 2, 2)["loss"], rel=1e-6)
    assert val_loss(model, rows, 2) == pytest.approx(evaluate_rows(model, rows, 2)["loss"], rel=1e-6)
    # A short last batch weighs its rows, not a full batch's: the loss of rows 3 at a time is theirs.
    assert evaluate_rows(model, rows, 3)["loss"] == pytest.approx(evaluate_rows(model, rows, 4)["loss"], rel=1e-6)
    assert abs(within - val_loss(model, rows, 2)) > 1e-4
    inputs = rows[:, :-1]
    apart = layer_similarity(model, [inputs], [document_ids(inputs, 2)])
    assert apart[2]["heads"] != layer_similarity(model, [inputs])[2]["heads"]


def test_converted_lisa_chains_keep_their_scores_unless_told():
    """lisa_config turns keep_chain_scores on where the new LISA layers form a chain, off where
    they do not, and leaves the choice to an explicit argument."""
    from models.attention.lisa import chained_lisa_layers
    from models.attention.lisa_conversion import lisa_config

    cfg = small_cfg("sssss")
    assert lisa_config(cfg, [2, 3]).lisa.keep_chain_scores
    assert not lisa_config(cfg, [2, 4]).lisa.keep_chain_scores
    assert not lisa_config(cfg, [2, 3], keep_chain_scores=False).lisa.keep_chain_scores
    assert lisa_config(cfg, [2], keep_chain_scores=True).lisa.keep_chain_scores
    assert chained_lisa_layers(["softmax", "lisa", "lisa", "lisa", "relu", "lisa"]) == [1, 2]


def test_conversion_keeps_chains_within_max_chain():
    """With a chain limit (convert_lisa --max-chain) layer choice by similarity skips a layer that
    would make more LISA layers in a row, even the most similar one, and takes the next; a listed set
    that would is refused, naming the run; a chain of the source's own that no new layer joins is
    not the conversion's concern."""
    from models.attention.lisa_conversion import chains, conversion_problem, propose_layers

    kinds = ["softmax"] * 8
    sim = {layer: {"similarity": 0.9 - 0.01 * layer} for layer in range(1, 8)}  # earlier: more similar
    assert propose_layers(sim, kinds, 1, 0.5, 0.75) == [1, 2, 3, 4, 5, 6]
    assert propose_layers(sim, kinds, 1, 0.5, 0.75, max_chain=2) == [1, 2, 4, 5, 7]
    assert propose_layers(sim, kinds, 1, 0.5, 0.75, max_chain=1) == [1, 3, 5, 7]
    assert conversion_problem(kinds, [2, 3, 4], 1, max_chain=2) == \
        "layers 2-4 would be 3 LISA layers in a row, more than 2"
    assert conversion_problem(kinds, [2, 3, 4], 1) is None
    source = ["softmax", "lisa", "lisa", "lisa", "softmax", "softmax", "softmax"]
    assert chains(source) == [(1, 3)]
    assert conversion_problem(source, [5], 1, max_chain=2) is None
    assert conversion_problem(source, [4], 1, max_chain=2) == \
        "layers 1-4 would be 4 LISA layers in a row, more than 2"
    # a softmax_sink layer: LISA after it computes plain softmax, so it is never replaced (its sink
    # logit would be lost), while it may stay as the source of a LISA layer after it
    sinks = ["softmax", "softmax_sink", "softmax"]
    assert "a softmax_sink layer: a LISA layer computes plain softmax" in conversion_problem(sinks, [1], 1)
    assert conversion_problem(sinks, [2], 1) is None
    assert propose_layers({1: {"similarity": 0.9}, 2: {"similarity": 0.8}}, sinks, 1, 0.5, 1.0) == [2]
    assert conversion_problem(kinds, [3, 8], 1) == "layer 8 is not a layer of this 8-layer model (0 to 7)"
    assert conversion_problem(kinds, [-1], 1) == "layer -1 is not a layer of this 8-layer model (0 to 7)"
    assert conversion_problem(kinds, [2, 2], 1) == "layers [2, 2] name a layer twice"  # trained twice a step


def test_convert_lisa_refuses_layers_twice_and_shards_without_val_before_reading_the_model(tmp_path, capsys):
    from tools.convert_lisa import main

    shards = tmp_path / "shards"
    (shards / "train").mkdir(parents=True)
    (shards / "train" / "index.json").write_text("{}")
    common = ["--checkpoint", str(tmp_path / "no_checkpoint"), "--out", str(tmp_path / "out")]
    assert main([*common, "--calib-shards", str(shards), "--layers", "2,3,2"]) == 2
    assert "--layers 2,3,2: layer 2 listed twice" in capsys.readouterr().err
    assert main([*common, "--calib-shards", str(shards), "--layers", "2"]) == 2
    assert "no val/ split, so the validation losses" in capsys.readouterr().err


def test_convert_lisa_options_fit_the_source_layout():
    """A model trained at parallel.tensor=2 converts to alignment groups that a rank holds whole (0,
    all heads, would straddle the ranks); a model with LISA layers keeps their shape settings."""
    from types import SimpleNamespace

    from tools.cli import ToolError
    from tools.convert_lisa import set_lisa_options

    def options(**given):
        return SimpleNamespace(**{"align_group": None, "align_hidden": None, "rank": None, "keep_full_layers": None,
                                  **given})

    dense = small_cfg("ssss")
    dense.lisa.align_group = 0
    set_lisa_options(dense, dense.attention_kinds(), options(), tensor=2)
    assert dense.lisa.align_group == 2  # 4 heads over 2 ranks
    with pytest.raises(ToolError, match="--align-group 4: groups of 4 heads must divide the 2 heads of each"):
        set_lisa_options(small_cfg("ssss"), ["softmax"] * 4, options(align_group=4), tensor=2)
    hybrid = small_cfg("sslss")
    with pytest.raises(ToolError, match=r"--rank 4 \(model.lisa.rank=0\).*has LISA layers already"):
        set_lisa_options(hybrid, hybrid.attention_kinds(), options(rank=4), tensor=1)
    set_lisa_options(hybrid, hybrid.attention_kinds(), options(align_group=2, keep_full_layers=2), tensor=1)
    assert (hybrid.lisa.align_group, hybrid.lisa.keep_full_layers) == (2, 2)  # the same group: nothing changes
    with pytest.raises(ToolError, match="keep_full_layers=4"):  # past the LISA layer at 2
        set_lisa_options(small_cfg("sslss"), hybrid.attention_kinds(), options(keep_full_layers=4), tensor=1)
    # The LISA layers to come are checked before any calibration pass, as the model would check them.
    head_dim = small_cfg("ssss").head_dim
    for given, message in (({"rank": 3}, r"model.lisa.rank=3 must be even"),
                           ({"rank": 2 * head_dim}, rf"model.lisa.rank={2 * head_dim} exceeds head_dim {head_dim}"),
                           ({"align_hidden": -1}, r"model.lisa.align_hidden=-1 must be >= 0")):
        with pytest.raises(ToolError, match=message + ".*--rank, --align-hidden"):
            set_lisa_options(small_cfg("ssss"), ["softmax"] * 4, options(**given), tensor=1)


@pytest.mark.parametrize("group,perm", [(2, [1, 0, 3, 2]), (4, [1, 2, 0, 3])])  # swaps; a 3-cycle
def test_convert_lisa_matches_heads_within_alignment_groups(single_process, group, perm):
    """A source whose layer 2 is layer 1 with heads permuted inside each alignment group (head h of
    layer 2 = head perm[h] of layer 1): the conversion finds the permutation, sets the alignment to
    it and, with the zero-started correction, computes exactly the source."""
    from models.attention.lisa_conversion import match_in_groups

    cfg = small_cfg("ssss")
    cfg.lisa.align_group = group
    source = permuted_source(cfg, perm)
    tokens = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(2))
    model, sim = converted(source, cfg, [2], "zero", tokens)
    assert match_in_groups(torch.tensor(sim[2]["heads"]), group) == perm
    mix = torch.zeros(4 // group, group, group, dtype=torch.float64)  # [group, new head, previous head]
    for new, previous in enumerate(perm):
        mix[new // group, new % group, previous % group] = 1.0
    assert torch.equal(model.blocks[2].attn.align.mix, mix)
    torch.testing.assert_close(model.logits(tokens), source.logits(tokens), rtol=0, atol=1e-10)


def test_convert_lisa_trained_qk_inits_are_exact_at_full_rank(single_process):
    """At rank = head_dim: "own" makes every converted layer the replaced one (grouped-query
    attention, two layers in a row); "residual" adds to the matched previous heads exactly the
    difference when it has one complex rank per RoPE pair. Below full rank both keep only the
    pairs the low-rank rotary has, so the model is no longer exact."""
    tokens = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(2))
    gqa = small_cfg("ssss", num_kv_heads=2)
    gqa.lisa.rank = gqa.head_dim
    source = build(gqa).double()
    model, _ = converted(source, gqa, [2, 3], "own", tokens)
    assert not model.blocks[2].attn.align.mix.any()
    torch.testing.assert_close(model.logits(tokens), source.logits(tokens), rtol=0, atol=1e-10)

    cfg = small_cfg("ssss")
    cfg.lisa.rank = cfg.head_dim
    source = permuted_source(cfg, [1, 0, 3, 2], pair_change=0.3)
    plain, _ = converted(source, cfg, [2], "zero", tokens)
    assert (plain.logits(tokens) - source.logits(tokens)).abs().max() > 1e-3  # the change matters
    model, _ = converted(source, cfg, [2], "residual", tokens)
    torch.testing.assert_close(model.logits(tokens), source.logits(tokens), rtol=0, atol=1e-10)
    cfg.lisa.rank = cfg.head_dim // 2
    low, _ = converted(source, cfg, [2], "residual", tokens)
    assert (low.logits(tokens) - source.logits(tokens)).abs().max() > 1e-6


def test_planner_counts_sink_scores_only_where_flex_attention_does_not_run():
    """softmax_sink keeps its seq^2 bias per head for backward through SDPA (CPU), none through
    FlexAttention (GPU), which takes heads 16 to FLEX_MAX_HEAD_DIM wide."""
    from models.attention.flex import FLEX_MAX_HEAD_DIM
    from models.registry import ActivationLayout, attention_kind

    sink, softmax = attention_kind("softmax_sink"), attention_kind("softmax")
    gpu = ActivationLayout(tensor=1, seq=24, flash=True, selective=False)
    cpu = ActivationLayout(tensor=1, seq=24, flash=False, selective=False)
    cfg = small_cfg("k")
    assert sink.activations(cfg, gpu) == softmax.activations(cfg, gpu)
    assert sink.activations(cfg, cpu) - sink.activations(cfg, gpu) == cfg.num_heads * 24
    for heads_of in (FLEX_MAX_HEAD_DIM + 64, 8):
        other = ModelConfig(hidden_size=2 * heads_of, num_heads=2, attention="k")
        assert sink.activations(other, gpu) - softmax.activations(other, gpu) == 2 * 24, heads_of


def test_planner_counts_no_features_where_the_fused_kernel_runs_linear_alignment():
    """Linear alignment in groups of 2 heads without grouped-query attention (two key heads per
    group): on a GPU the fused kernel runs the LISA layers right after full layers (1 and 4 of
    sllrl), which keep their inputs only, as an FFN-aligned layer does, and a chain's second layer
    (2), which keeps the first one's mixed queries and keys (2 key heads x head_dim 16 wide); a
    third (slllrl) attends over score features (2 x 16 + rank 2, + rank 2 per head of each earlier
    layer's group), and so does the second where the keys side by side are wider than the kernel
    takes (head_dim 128). With one key head per group the queries are mixed first, and kept beside
    the scaled ones; the chain's second layer keeps nothing more. Without the kernels (CPU, or
    kernel=torch) every layer attends over features."""
    from models.attention.base import projected_activations
    from models.attention.lisa import lisa_activations
    from models.registry import ActivationLayout

    gpu = ActivationLayout(tensor=1, seq=24, flash=True, selective=False)
    cpu = ActivationLayout(tensor=1, seq=24, flash=False, selective=False)

    def configs(attention: str, **extra):
        linear, ffn = small_cfg(attention, **extra), small_cfg(attention, **extra)
        linear.lisa.align_hidden = 0
        return linear, ffn, projected_activations(linear, gpu, stores_scores=False)

    linear, ffn, inputs = configs("sllrl")
    hidden, heads = linear.hidden_size, linear.num_heads
    second = inputs + 2 * hidden + linear.kv_width  # the first layer's mixed queries and keys
    assert 3 * lisa_activations(linear, gpu) == 2 * lisa_activations(ffn, gpu) + second
    features = {depth: 2 * heads * (2 * 16 + 2 + 2 * 2 * (depth - 1)) for depth in (1, 2, 3)}
    assert 3 * lisa_activations(linear, cpu) == (2 * features[1] + features[2]
                                                  + 3 * projected_activations(linear, cpu, stores_scores=True))
    linear.lisa.kernel = "torch"  # no Triton kernels: features everywhere
    assert 3 * lisa_activations(linear, gpu) == 2 * features[1] + features[2] + 3 * inputs
    longer, longer_ffn, _ = configs("slllrl")
    assert 4 * lisa_activations(longer, gpu) == (2 * lisa_activations(longer_ffn, gpu) + second
                                                  + inputs + features[3])
    wide = ModelConfig(hidden_size=512, num_heads=4, num_layers=5, attention="sllrl",  # head_dim 128, rank 16
                       lisa=LISAConfig(align_group=2, keep_full_layers=1, align_hidden=0))
    wide_ffn = ModelConfig(hidden_size=512, num_heads=4, num_layers=5, attention="sllrl",
                           lisa=LISAConfig(align_group=2, keep_full_layers=1))
    wide_features = 2 * 4 * (2 * 128 + 16 + 2 * 16)
    assert 3 * lisa_activations(wide, gpu) == (2 * lisa_activations(wide_ffn, gpu) + wide_features
                                                + projected_activations(wide, gpu, stores_scores=False))
    # one key head per group (2 K/V heads)
    gqa, gqa_ffn, gqa_inputs = configs("sllrl", num_kv_heads=2)
    assert 3 * lisa_activations(gqa, gpu) == 2 * (lisa_activations(gqa_ffn, gpu) + hidden) + gqa_inputs


def test_weight_decay_leaves_lisa_head_mixing_and_biases_alone(single_process):
    """AdamW's decay pulls a parameter towards zero: right for weight matrices, wrong for LISA's head
    mixing (it starts as the identity, the inherited scores) and its 2-D biases."""
    from models.gpt import GPT
    from pretrain.engine import param_groups

    cfg = small_cfg("kssl")
    cfg.lisa.align_hidden = 16
    model = GPT(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in param_groups(model)}
    align = [n for n in names.values() if ".align." in n]
    assert sorted(n.rsplit(".", 1)[1] for n in align) == ["b1", "b2", "mix", "w1", "w2"]
    assert [n.rsplit(".", 1)[1] for n in groups["no_decay"] if n in align] == ["b1", "b2", "mix"]
    assert [n.rsplit(".", 1)[1] for n in groups["decay"] if n in align] == ["w1", "w2"]
    assert all(model.get_parameter(n).dim() < 2 for n in groups["no_decay"] if n not in align)  # norms, sink
    weights = {"embed.weight", "head.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.w_in.weight"}
    assert weights <= set(groups["decay"])
    before = {g["name"]: {names[id(p)] for p in g["params"]} for g in param_groups(model, version=1)}
    assert set(align) <= before["decay"]  # the groups of checkpoints saved before: resumed as they were


class ScriptedLogits(torch.nn.Module):
    """A stand-in model for generate(): the logits of step i are script[i] (the last row of the
    script once past it), whatever the tokens; it keeps a KV cache's length as GPT does."""

    def __init__(self, script: list[list[float]]):
        super().__init__()
        self.cfg = small_cfg("s")
        self.cfg.vocab_size = len(script[0])
        self.script, self.step = torch.tensor(script), 0
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the device generate() reads
        self.inputs: list[list[int]] = []  # what each forward ran

    def hidden_states(self, tokens, ctx=None):
        self.inputs.append(tokens[0].tolist())
        if ctx and ctx.get("kv_cache") is not None:
            ctx["kv_cache"].length += tokens.shape[1]
        return torch.zeros(1, tokens.shape[1], 1)

    def output_logits(self, hidden):
        row = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return row.expand(1, hidden.shape[1], -1)


def test_generate_samples_at_the_temperature_and_stops_at_eos():
    from models.generation import filter_top_p, generate

    # top-p keeps the most likely tokens until their mass reaches it, renormalised.
    kept = filter_top_p(torch.tensor([0.15, 0.5, 0.05, 0.3]), 0.7)
    torch.testing.assert_close(kept, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    assert torch.equal(filter_top_p(torch.tensor([0.2, 0.8]), 1.0), torch.tensor([0.2, 0.8]))
    # the most likely token alone reaches top_p exactly: nothing else is kept
    assert torch.equal(filter_top_p(torch.tensor([0.5, 0.3, 0.2]), 0.5), torch.tensor([1.0, 0.0, 0.0]))
    # Greedy decoding stops after the EOS it draws (one id or several), or runs on without one.
    script = [[0, 0, 0, 0, 0, 9, 0, 0], [0, 0, 9, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 9]]
    for eos, want in ((2, [5, 2]), ([7, 2], [5, 2]), (None, [5, 2, 7, 7])):
        assert generate(ScriptedLogits(script), [1, 3], 4, greedy=True, eos_id=eos) == want, eos
    assert generate(ScriptedLogits(script), [1, 3], 4, temperature=0.0) == [5, 2, 7, 7]  # temperature 0: greedy
    # Sampling draws from softmax(logits / T).
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 2.0):
        gen = torch.Generator().manual_seed(0)
        draws = [generate(ScriptedLogits([logits.tolist()]), [1], 1, temperature=temperature, generator=gen)[0]
                 for _ in range(4000)]
        freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
        torch.testing.assert_close(freq, torch.softmax(logits / temperature, -1), atol=0.025, rtol=0)
    # A tiny temperature draws the most likely token (logits / T would overflow to inf - inf = NaN)
    assert all(generate(ScriptedLogits([logits.tolist()]), [1], 1, temperature=t) == [0] for t in (1e-40, 1e-300))
    # Past max_seq_len the context slides; a prompt beginning with the run's BOS keeps it first.
    model = ScriptedLogits(script)
    model.cfg.max_seq_len = 4
    assert generate(model, [1, 3, 4], 4, greedy=True, bos=1) == [5, 2, 7, 7]
    assert model.inputs[2:] == [[1, 4, 5, 2], [1, 5, 2, 7]]  # the cache ran [1, 3, 4], then [5]


def test_lisa_adds_its_low_rank_scores_at_one_over_sqrt_rank(single_process):
    """Identity alignment and a live low-rank term at rank 2 < head_dim 16: the LISA layer's weights
    are softmax(S_prev + (x Wq_r)(x Wk_r)^T / sqrt(r)), with RoPE on the rank-r pairs; S_prev from
    the source layer's weights (log of them: a row's constant does not change a softmax)."""
    from models.gpt import GPT

    cfg = small_cfg("sl")
    torch.manual_seed(0)
    model = GPT(cfg).double()
    lisa = model.blocks[1].attn
    rank, heads = lisa.rank, cfg.num_heads
    assert rank == 2 and cfg.hidden_size // heads == 16
    with torch.no_grad():
        lisa.qk.weight.normal_(std=0.5)
    inputs = {}
    hook = lisa.register_forward_pre_hook(lambda module, args: inputs.update(x=args[0]))
    ctx = {"capture_attention": True}
    model.logits(torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5)), ctx)
    hook.remove()
    x, source, shared = inputs["x"].detach(), ctx["attention_maps"][0], ctx["attention_maps"][1]
    q, k = (x @ lisa.qk.weight.T).view(2, 24, heads, 2, rank).permute(3, 0, 2, 1, 4).unbind(0)
    low = lisa.rotary(q) @ lisa.rotary(k).transpose(-1, -2) / math.sqrt(rank)
    future = torch.ones(24, 24, dtype=torch.bool).triu(1)
    want = torch.softmax((source.log() + low).masked_fill(future, float("-inf")), -1)
    torch.testing.assert_close(shared, want, rtol=0, atol=1e-12)


def test_sensitivity_takes_the_least_sensitive_layers_while_the_whole_set_fits_the_budget(monkeypatch):
    """Least sensitive first, a layer joins when its set's measured loss increase stays within the
    budget: layers 2 and 3 cost little alone but much together, so 3 is left out and 4 taken; a
    layer over the budget alone never joins. (The models are stand-ins: the loss of a set of
    converted layers is given.)"""
    from models.attention import lisa_conversion

    alone = {1: 0.05, 2: 0.01, 3: 0.02, 4: 0.03, 5: 0.5}

    def increase(layers):
        return sum(alone[layer] for layer in layers) + (0.1 if {2, 3} <= set(layers) else 0.0)

    source = object()
    monkeypatch.setattr(lisa_conversion, "build_lisa_model", lambda source, cfg, new, layers, *rest: tuple(layers))
    loss = lambda model: 2.0 if model is source else 2.0 * (1 + increase(model))  # noqa: E731
    chosen, measured = lisa_conversion.sensitive_layers(source, small_cfg("ssssss"), {}, loss, "zero", budget=0.06,
                                                        max_fraction=1.0)
    assert measured == pytest.approx(alone) and chosen == [2, 4]
    # At most max_fraction of the layers: one of six here.
    chosen, _ = lisa_conversion.sensitive_layers(source, small_cfg("ssssss"), {}, loss, "zero", budget=0.06,
                                                 max_fraction=0.2)
    assert chosen == [2]
