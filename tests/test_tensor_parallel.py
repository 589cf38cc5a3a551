"""Tensor parallelism: a TP=2 model equals the TP=1 model built from the same seed."""

import pytest
import torch

from tests.dist_utils import spawn
from tests.parallel_checks import gpt_loss_and_grads

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
