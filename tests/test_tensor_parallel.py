"""Tensor parallelism: a TP=2 model equals the TP=1 model built from the same seed."""

import pytest
import torch

from tests.dist_utils import spawn
from tests.parallel_checks import bytes_saved_for_backward, cross_entropy_and_logsumexp_grads, gpt_loss_and_grads

MODEL = dict(vocab_size=300, hidden_size=64, num_heads=4, num_layers=2, ffn_hidden_size=96, max_seq_len=32)


@pytest.mark.parametrize("tie", [False, True])
def test_tp2_matches_tp1_loss_and_grads(tmp_path, tie):
    kwargs = {**MODEL, "tie_embeddings": tie}
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "tp1.pt"))
    spawn(gpt_loss_and_grads, 2, kwargs, str(tmp_path / "tp2.pt"), tensor=2)
    ref, tp = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert ref["grads"].keys() == tp["grads"].keys()
    for name in ref["weights"]:
        torch.testing.assert_close(tp["weights"][name], ref["weights"][name], rtol=0, atol=0, msg=name)
    # fp32; different reduction orders across ranks give ~1e-7 differences.
    torch.testing.assert_close(tp["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    for name in ref["grads"]:
        torch.testing.assert_close(tp["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tensor", [1, 2])
def test_cross_entropy_and_logsumexp_are_the_plain_formulas_with_their_gradients(tmp_path, tensor):
    """The z-loss's one-pass cross-entropy: values and gradients of both outputs (weighted apart, so
    a mixed-up term shows) against F.cross_entropy and torch.logsumexp on the whole vocabulary."""
    import torch.nn.functional as F

    spawn(cross_entropy_and_logsumexp_grads, tensor, str(tmp_path / "ce.pt"), tensor=tensor)
    got = torch.load(tmp_path / "ce.pt")
    logits = got["logits"].clone().requires_grad_()
    ce = F.cross_entropy(logits.flatten(0, 1), got["labels"].flatten(), reduction="none").view_as(got["w_ce"])
    lse = torch.logsumexp(logits, -1)
    ((ce * got["w_ce"]).sum() + (lse * got["w_lse"]).sum()).backward()
    torch.testing.assert_close(got["ce"], ce.detach())
    torch.testing.assert_close(got["lse"], lse.detach())
    torch.testing.assert_close(got["grad"], logits.grad)


def test_z_loss_is_the_formula_and_tp2_matches_tp1(tmp_path):
    coef = 0.05
    spawn(gpt_loss_and_grads, 1, MODEL, str(tmp_path / "off.pt"))
    spawn(gpt_loss_and_grads, 1, MODEL, str(tmp_path / "tp1.pt"), 0, False, False, coef)
    spawn(gpt_loss_and_grads, 2, MODEL, str(tmp_path / "tp2.pt"), 0, False, False, coef, tensor=2)
    off, ref, tp = (torch.load(tmp_path / f"{n}.pt") for n in ("off", "tp1", "tp2"))
    # TP=1 holds the whole (padded) vocabulary: the reference formula on plain logsumexp.
    want = coef * torch.logsumexp(ref["logits"].float(), dim=-1).square().mean()
    torch.testing.assert_close(ref["z_loss"], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(ref["loss"] - off["loss"], want, rtol=1e-5, atol=1e-7)
    assert off["z_loss"] is None and want > 0.1
    torch.testing.assert_close(tp["z_loss"], ref["z_loss"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(tp["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    for name in ref["grads"]:
        torch.testing.assert_close(tp["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
    # The term has a gradient: the head's gradient moves with it.
    assert not torch.allclose(ref["grads"]["head.weight"], off["grads"]["head.weight"], atol=1e-6)


def test_the_z_loss_keeps_no_second_logits_sized_tensor_for_backward(tmp_path):
    """Its logsumexp comes out of the cross-entropy's pass (what launch.plan counts)."""
    kwargs = {**MODEL, "vocab_size": 4096}  # the logits dominate what the forward keeps
    for coef in (0.0, 0.05):
        spawn(bytes_saved_for_backward, 1, kwargs, coef, str(tmp_path / f"{coef}.pt"))
    off, on = (torch.load(tmp_path / f"{coef}.pt") for coef in (0.0, 0.05))
    logits_bytes = 2 * 16 * 4096 * 4  # fp32 [batch, seq, vocab]
    assert off > logits_bytes and on - off < logits_bytes / 16, (off, on)



@pytest.mark.slow
def test_zero3_trains_a_model_with_tied_embeddings(tmp_path):
    """ZeRO-3 gathers a parameter while its own module runs; the tied output layer reads the
    embedding's weight after that (it got an empty partition): the losses are ZeRO-1's."""
    import json

    from tests.dist_utils import train
    from tests.synthetic import tiny_overrides, write_synthetic_shards

    data = write_synthetic_shards(tmp_path / "data")
    losses = {}
    for stage in (1, 3):
        run = tmp_path / f"zero{stage}"
        train(1, tiny_overrides(data, run, **{"train.steps": 3, "parallel.zero_stage": stage,
                                              "model.tie_embeddings": "true", "train.eval_interval": 100,
                                              "train.save_interval": 100}))
        losses[stage] = [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert len(losses[3]) == 3
    assert losses[3] == pytest.approx(losses[1], rel=1e-6)
