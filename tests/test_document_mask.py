"""Document masking: a packed sample gives each of its documents the logits it gets alone, for every
attention kind, on the fast and on the score-materialising path, at TP=1 and TP=2; ReLU's prefix
normaliser counts same-document keys; a masked training run passes the document ids through."""

from __future__ import annotations

import json

import pytest
import torch

from models.attention.masks import document_ids, keys_seen, visible
from models.attention.relu import relu_attention, relu_weights
from tests.dist_utils import spawn, train
from tests.parallel_checks import gpt_loss_and_grads
from tests.synthetic import tiny_overrides, write_synthetic_shards
from tests.test_attention import VOCAB, single_process, small_cfg  # noqa: F401 (fixture)

EOS = 2


def test_document_ids_masks_and_counts():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 9], [EOS, 5, 6, 7, 8, EOS, 9, 9]])
    docs = document_ids(tokens, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]]
    mask = visible(8, 8, tokens.device, docs)[:, 0]
    for b in range(2):
        for i in range(8):
            assert mask[b, i].tolist() == [j <= i and docs[b, j] == docs[b, i] for j in range(8)]
    assert keys_seen(docs, 8)[:, 0, :, 0].tolist() == [[1, 2, 3, 1, 2, 1, 2, 3], [1, 1, 2, 3, 4, 5, 1, 2]]


@pytest.mark.parametrize("within_documents", [True, False])
@pytest.mark.parametrize("sink", [False, True])
def test_flex_path_equals_masked_sdpa(sink, within_documents):
    """What GPUs run within documents (FlexAttention with a block mask; the sink kind through the
    returned log-sum-exp, with or without documents) gives the SDPA path's outputs, with
    grouped-query heads. FlexAttention has no backward on CPU: this is the forward; the GPU check
    times the backward."""
    from models.attention.flex import document_block_mask, flex_masked_attention
    from models.attention.sink import sink_softmax_attention
    from models.attention.softmax import softmax_attention

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 50, (2, 37), generator=gen)
    tokens[0, [5, 20]], tokens[1, 11] = EOS, EOS
    docs = document_ids(tokens, EOS) if within_documents else None
    q = torch.randn(2, 4, 37, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 37, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    heads_sink = torch.randn(4, generator=gen, dtype=torch.float64) if sink else None
    out = flex_masked_attention(q, k, v, document_block_mask(docs, 37, 37, q.device), sink=heads_sink)
    ref = sink_softmax_attention(q, k, v, heads_sink, docs) if sink else softmax_attention(q, k, v, docs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if within_documents:
        one_document = document_block_mask(torch.zeros_like(docs), 37, 37)
        plain = flex_masked_attention(q, k, v, one_document, sink=heads_sink)
        assert (plain - out).abs().max() > 1e-3  # the documents matter
    elif sink:
        assert (out - softmax_attention(q, k, v)).abs().max() > 1e-3  # the sink logits matter


@pytest.mark.parametrize("normalizer", ["prefix", "content", "seqlen", "none"])
def test_relu_weights_count_only_same_document_keys(normalizer):
    torch.manual_seed(0)
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 5, 6]])
    docs = document_ids(tokens, EOS)
    scores = torch.randn(1, 2, 9, 9)
    weights = relu_weights(scores, normalizer, docs)
    bounds = [(0, 3), (3, 7), (7, 9)]
    for start, end in bounds:
        for i in range(start, end):
            # seqlen: no look at the document's end
            n = {"prefix": i - start + 1, "content": max(i - start, 1), "seqlen": 9, "none": 1}[normalizer]
            want = torch.zeros(2, 9)
            want[:, start:i + 1] = scores[0, :, i, start:i + 1].relu() / n
            torch.testing.assert_close(weights[0, :, i], want)
    # The blocked kernel (forward and backward) gives what the explicit weights give.
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    fast = relu_attention(q, k, v, normalizer, block=4, documents=docs)
    ref = relu_weights(q @ k.transpose(-2, -1) / 8 ** 0.5, normalizer, docs) @ v
    torch.testing.assert_close(fast, ref)
    grads = torch.autograd.grad(fast.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("attention", ["s", "k", "r", "sl", "rl", "krl"])
@pytest.mark.parametrize("capture", [False, True])
def test_packed_documents_get_their_own_logits(single_process, attention, capture):  # noqa: F811
    from models.gpt import GPT

    cfg = small_cfg(attention)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [(7, 9, 5), (4, 12, 5)]  # the last document of each row has no EOS (cut by the sample)
    rows, pieces = [], []
    for row in lengths:
        docs = [torch.randint(4, VOCAB, (n,), generator=gen) for n in row]
        for d in docs[:-1]:
            d[-1] = EOS
        rows.append(torch.cat(docs))
        pieces.append(docs)
    packed = torch.stack(rows)
    with torch.no_grad():
        got = model.logits(packed, {"document_ids": document_ids(packed, EOS), "capture_attention": capture})
        plain = model.logits(packed, {"capture_attention": capture})
        for b, docs in enumerate(pieces):
            start = 0
            for d in docs:
                alone = model.logits(d[None], {"capture_attention": capture})[0]
                torch.testing.assert_close(got[b, start:start + len(d)], alone, rtol=1e-4, atol=1e-5)
                start += len(d)
    assert not torch.allclose(got, plain, atol=1e-3)  # across documents, attention differs


MODEL = dict(vocab_size=300, hidden_size=64, num_heads=4, num_layers=3, ffn_hidden_size=96, max_seq_len=32,
             attention="krl", lisa={"align_group": 2, "keep_full_layers": 1})


def test_tp2_with_document_mask_matches_tp1(tmp_path):
    spawn(gpt_loss_and_grads, 1, MODEL, str(tmp_path / "tp1.pt"), 0, False, False, 0.0, EOS)
    spawn(gpt_loss_and_grads, 2, MODEL, str(tmp_path / "tp2.pt"), 0, False, False, 0.0, EOS, tensor=2)
    spawn(gpt_loss_and_grads, 1, MODEL, str(tmp_path / "plain.pt"))
    ref, tp, plain = (torch.load(tmp_path / f"{n}.pt") for n in ("tp1", "tp2", "plain"))
    torch.testing.assert_close(tp["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    for name in ref["grads"]:
        torch.testing.assert_close(tp["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
    assert abs(float(ref["loss"]) - float(plain["loss"])) > 1e-4


def test_masked_training_runs_pass_the_documents(tmp_path):
    data = write_synthetic_shards(tmp_path / "data", eos_id=EOS)
    runs = {}
    for name, extra in (("masked", {"data.document_mask": "true"}), ("plain", {}),
                        ("masked_tp2", {"data.document_mask": "true", "parallel.tensor": 2})):
        run = tmp_path / name
        train(2 if name.endswith("tp2") else 1, tiny_overrides(data, run, **{"train.steps": 3, **extra}))
        runs[name] = [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert runs["masked_tp2"] == pytest.approx(runs["masked"], rel=1e-5, abs=1e-6)
    assert runs["masked"] != pytest.approx(runs["plain"], rel=1e-4)


def test_document_mask_needs_the_eos_id(tmp_path):
    from pretrain.config import ConfigError, load_config, validate_data

    data = write_synthetic_shards(tmp_path / "data")  # its manifest records no EOS id
    cfg = load_config(None, tiny_overrides(data, tmp_path / "run", **{"data.document_mask": "true"}))
    with pytest.raises(ConfigError, match="data.document_mask=true needs the EOS id.*build_shards"):
        validate_data(cfg)
