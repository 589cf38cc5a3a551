"""Post-training: SFT masks, DPO and SGA losses against plain formulas, data converters, and real
gloo runs (TP=2 and ZeRO-2 DPO against one process, SFT / DPO resume, SGA inference and export)."""

import gzip
import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.config import ConfigError
from posttrain.batches import (
    ExampleBatches,
    PairExample,
    Row,
    chunked,
    collate_pairs,
    collate_rows,
    fixed_batches,
    pack,
    response_row,
)
from posttrain.chat import ChatEncoder, ChatFormat, ScoreFormat, with_scores
from posttrain.convert import convert
from tests.dist_utils import REPO, child_env, saved_run_copy, single_process_group, torchrun

WORDS = "red green blue fast slow big small tree river stone light dark".split()
MODEL = {"model.vocab_size": 400, "model.max_seq_len": 96, "model.hidden_size": 64, "model.num_heads": 4,
         "model.num_layers": 2, "model.ffn_hidden_size": 128}


def model_config():
    from pretrain.config import load_config

    return load_config(None, [f"{k}={v}" for k, v in MODEL.items()]).model


@pytest.fixture(scope="module")
def encoder(tok_dir):
    from data_prep.tokenizer import load_tokenizer

    return ChatEncoder(load_tokenizer(tok_dir)[0], ChatFormat())


@pytest.fixture(scope="module")
def files(tmp_path_factory, tok_dir):
    """Starting weights (a consolidated-format file), SFT and preference JSONL with scores."""
    from models.gpt import GPT

    root = tmp_path_factory.mktemp("posttrain")
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(model_config())
        torch.save({"model": model.cfg.to_dict(), "state_dict": model.state_dict()}, root / "init.pt")
    rng = random.Random(0)
    with open(root / "sft.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=5)),
                                "response": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))}) + "\n")
        f.write("{broken\n")
    with open(root / "pref.jsonl", "w") as f:
        for _ in range(24):
            n = rng.randint(1, 4)
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=4)), "chosen": " ".join(["tree"] * n),
                                "rejected": " ".join(rng.choices(WORDS, k=3)),
                                "scores": {"length": n / 4, "keyword": 1.0}}) + "\n")
        f.write(json.dumps({"prompt": "x", "chosen": "y", "rejected": "z", "scores": {"length": 2}}) + "\n")
    return root


# ---- chat encoding and SFT masks


def test_conversation_trains_exactly_the_assistant_turns(encoder):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red tree"},
                {"role": "assistant", "content": "import data"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "the model"}]
    ids, trained = encoder.conversation(messages)
    sp, eos = encoder.sp, encoder.eos
    expected_ids, expected_mask = [], []
    for text, is_target in [("System: be brief\n", False), ("User: red tree\n", False), ("Assistant:", False),
                            ("Assistant: import data", True), (None, True), ("User: more\n", False),
                            ("Assistant:", False), ("Assistant: the model", True), (None, True)]:
        piece = [eos] if text is None else sp.encode(text)
        if is_target and text:  # the response as running text tokenizes it, after the prefix's tokens
            head = sp.encode("Assistant:")
            assert piece[:len(head)] == head
            piece = piece[len(head):]
            assert sp.id_to_piece(piece[0]) in ("\u2581import", "\u2581the"), sp.id_to_piece(piece[0])
        expected_ids += piece
        expected_mask += [is_target] * len(piece)
    assert ids.tolist() == expected_ids and trained.tolist() == expected_mask
    # A preference prompt plus its response is the same sequence as the conversation.
    assert encoder.prompt(messages[:-1]) + encoder.response("the model") == expected_ids


def test_a_format_recorded_before_prefix_spaces_keeps_prefix_and_response_apart(encoder):
    """Checkpoints post-trained before post.prefix_spaces_in_response: their runs resume, and their
    prompts end, as they were encoded."""
    import types

    from posttrain.chat import inherit_chat_format

    legacy = {k: v for k, v in ChatFormat().__dict__.items() if k != "prefix_spaces_in_response"}
    post = types.SimpleNamespace(**ChatFormat().__dict__)
    assert inherit_chat_format(post, legacy) == ["post.prefix_spaces_in_response=False: the start checkpoint's "
                                                 "chat format"]
    old, sp = ChatEncoder(encoder.sp, ChatFormat.from_config(post)), encoder.sp
    assert old.fmt == ChatFormat.recorded(legacy)
    user = [{"role": "user", "content": "red tree"}]
    assert old.prompt(user) == sp.encode("User: red tree\n") + sp.encode("Assistant: ")
    assert old.response("import data") == sp.encode("import data") + [sp.eos_id()]
    assert encoder.prompt(user) + encoder.response("import data") != old.prompt(user) + old.response("import data")


def test_a_decoded_response_encodes_to_the_same_ids(encoder):
    """What a model generated after the prompt, decoded (sampled answers to label and prune, SGA's
    text), is a turn's content whose response() gives those ids again: its first word's space
    belongs to the prefix and is not a leading space of the text (which encodes as another token)."""
    legacy = ChatEncoder(encoder.sp, ChatFormat.recorded({k: v for k, v in ChatFormat().__dict__.items()
                                                          if k != "prefix_spaces_in_response"}))
    for enc in (encoder, legacy):
        for text in ("UNSAFE: the recipe", "red tree, dark river.", "import os"):
            ids = enc.response(text)[:-1]  # as generated, EOS dropped
            assert enc.decode_response(ids) == text
            assert enc.response(enc.decode_response(ids))[:-1] == ids


def _reference_nll(model, tokens, trained):
    logits = model.logits(tokens[:, :-1]).float()
    nll = -torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = trained[:, 1:].float()
    return (nll * mask).sum(), mask.sum()


def test_sft_loss_is_the_mean_over_response_tokens_padded_or_packed(encoder):
    from posttrain.model import PostTrainModel

    a = Row(*encoder.conversation([{"role": "user", "content": "red tree big"},
                                   {"role": "assistant", "content": "green"}]))
    b = Row(*encoder.conversation([{"role": "user", "content": "slow"},
                                   {"role": "assistant", "content": "dark stone light river"}]))
    with single_process_group():
        torch.manual_seed(1)
        model = PostTrainModel(model_config(), "sft").eval()
        padded = collate_rows([a, b], pad_id=3)
        # the inputs that are not padding (routed MLPs count only these: test_moe_layers)
        width = padded["tokens"].shape[1] - 1
        assert padded["real"].tolist() == [[i < len(r.ids) for i in range(width)] for r in (a, b)]
        sums = [_reference_nll(model, torch.from_numpy(r.ids)[None], torch.from_numpy(r.trained)[None]) for r in (a, b)]
        expected = sum(s for s, _ in sums) / sum(c for _, c in sums)
        torch.testing.assert_close(model(padded), expected, rtol=1e-5, atol=1e-6)
        # Packed into one row, each example attends only to itself: the same tokens, the same loss.
        packed = collate_rows(pack([a, b], length=97), pad_id=3)
        assert packed["tokens"].shape[0] == 1 and packed["documents"][0, len(a.ids)].item() == 1
        torch.testing.assert_close(model(packed), expected, rtol=1e-5, atol=1e-6)
        # Without the document mask the second example would see the first: the check can fail.
        del packed["documents"]
        assert not torch.allclose(model(packed), expected, rtol=1e-4)


def test_padding_stays_out_of_routing_in_post_training():
    """A padded batch through the policy (SFT, and SGA's value head on the raw prompts): its UoE
    layers count the real tokens only (the token mask reaches them through every block)."""
    from models.moe.routing import sparse_layers
    from pretrain.config import load_config
    from posttrain.model import PostTrainModel

    uoe = {"model.mlp": "uoe", "model.moe.num_experts": 4, "model.moe.top_k": 2,
           "model.moe.expert_hidden_size": 32, "model.moe.shared_hidden_size": 16}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**MODEL, **uoe}.items()]).model
    rng = random.Random(0)
    rows = [response_row([rng.randrange(4, 400) for _ in range(n)], [5, 6, 2]) for n in (3, 9)]
    batch = collate_rows(rows, pad_id=3)
    with single_process_group():
        torch.manual_seed(0)
        head = {"hidden_size": cfg.hidden_size, "objectives": ["a"], "layers": 1, "width": 8, "dropout": 0.0}
        model = PostTrainModel(cfg, "sft", value_head=head).train()
        model(batch)
        lengths = [len(r.ids) for r in rows]  # padded to a multiple of 8: 16 positions, 15 inputs
        assert all(layer.stats.totals()["tokens"] == sum(lengths) for layer in sparse_layers(model))
        prompts = torch.tensor([[7, 8, 3, 3], [7, 8, 9, 10]])
        for layer in sparse_layers(model):
            layer.stats.reset()
        model.predict_scores(prompts, torch.tensor([1, 3]))
        assert all(layer.stats.totals()["tokens"] == 6 for layer in sparse_layers(model))


# ---- DPO and SGA losses


def _pair(rng, prompt_len, chosen_len, rejected_len, scores=()):
    draw = lambda n: [rng.randrange(4, 400) for _ in range(n)]  # noqa: E731
    prompt = draw(prompt_len)
    return PairExample(response_row(prompt, draw(chosen_len)), response_row(prompt, draw(rejected_len)), prompt,
                       np.array(scores, dtype=np.float32))


def test_padding_keeps_every_row_and_raw_prompt_within_the_model_s_positions():
    """cap = model.max_seq_len + 1 (not a multiple of 8): the pair rows (inputs and the last label) pad
    to it, SGA's raw prompt (inputs only) to one less."""
    batch = collate_pairs([_pair(random.Random(1), 97, 2, 1, (0.5,))], pad_id=3, cap=101)
    assert batch["tokens"].shape[1] == 101 and batch["prompt_tokens"].shape[1] == 100


def test_dpo_loss_and_gradients_equal_the_plain_formula():
    from models.gpt import GPT
    from posttrain.model import PostTrainModel

    rng = random.Random(0)
    batch = collate_pairs([_pair(rng, 5, 3, 6), _pair(rng, 7, 4, 2), _pair(rng, 3, 8, 5)], pad_id=3)
    beta = 0.3
    with single_process_group():
        torch.manual_seed(2)
        policy = PostTrainModel(model_config(), "dpo", beta=beta)
        torch.manual_seed(3)
        policy.set_reference(GPT(model_config()))
        loss = policy(batch)
        grads = torch.autograd.grad(loss, list(policy.parameters()))

        def summed(model):
            logp = torch.log_softmax(model.logits(batch["tokens"][:, :-1]).float(), -1)
            picked = logp.gather(-1, batch["tokens"][:, 1:, None])[..., 0]
            return (picked * batch["trained"][:, 1:]).sum(-1)

        pi = summed(policy)
        with torch.no_grad():
            ref = summed(policy._reference[0])
        expected = -F.logsigmoid(beta * ((pi[:3] - ref[:3]) - (pi[3:] - ref[3:]))).mean()
        expected_grads = torch.autograd.grad(expected, list(policy.parameters()))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert expected.item() != pytest.approx(math.log(2), abs=1e-3)  # policy and reference differ
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    margin = beta * ((pi[:3] - ref[:3]) - (pi[3:] - ref[3:]))
    metrics = policy.last_metrics
    torch.testing.assert_close(metrics["reward_margin"], margin.mean().detach())
    assert metrics["reward_accuracy"].item() == pytest.approx((margin > 0).float().mean().item())
    torch.testing.assert_close(metrics["reward_chosen"], beta * (pi[:3] - ref[:3]).mean().detach())
    torch.testing.assert_close(metrics["reward_rejected"], beta * (pi[3:] - ref[3:]).mean().detach())
    # The variants, as TRL computes them: cDPO's label smoothing; IPO on per-token mean log-probs
    h = (pi[:3] - ref[:3]) - (pi[3:] - ref[3:])
    tokens = batch["trained"][:, 1:].sum(-1)
    with single_process_group():
        smoothed = PostTrainModel(model_config(), "dpo", beta=beta, label_smoothing=0.2)
        ipo = PostTrainModel(model_config(), "dpo", beta=beta, preference_loss="ipo")
        for variant in (smoothed, ipo):
            variant.load_state_dict(policy.state_dict())
            variant.set_reference(policy._reference[0])
        want = -(0.8 * F.logsigmoid(beta * h) + 0.2 * F.logsigmoid(-beta * h)).mean()
        torch.testing.assert_close(smoothed(batch), want, rtol=1e-5, atol=1e-6)
        pi_mean, ref_mean = pi / tokens, ref / tokens
        h_mean = (pi_mean[:3] - ref_mean[:3]) - (pi_mean[3:] - ref_mean[3:])
        torch.testing.assert_close(ipo(batch), ((h_mean - 1 / (2 * beta)) ** 2).mean(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ipo.last_metrics["reward_margin"], beta * h_mean.mean().detach())
        hinge = PostTrainModel(model_config(), "dpo", beta=beta, preference_loss="hinge")
        hinge.load_state_dict(policy.state_dict())
        hinge.set_reference(policy._reference[0])
        torch.testing.assert_close(hinge(batch), torch.relu(1 - beta * h).mean(), rtol=1e-5, atol=1e-6)
        # SimPO: no reference; per-token mean log-probs against a margin gamma
        simpo = PostTrainModel(model_config(), "dpo", beta=beta, preference_loss="simpo", label_smoothing=0.1,
                               simpo_gamma=0.4)
        simpo.load_state_dict(policy.state_dict())
        got = simpo(batch)
        pi_mean = summed(policy) / tokens  # a graph of its own
        logits = beta * (pi_mean[:3] - pi_mean[3:]) - 0.4
        want = -(0.9 * F.logsigmoid(logits) + 0.1 * F.logsigmoid(-logits)).mean()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got_grad, want_grad in zip(torch.autograd.grad(got, list(simpo.parameters())),
                                       torch.autograd.grad(want, list(policy.parameters()))):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(simpo.last_metrics["reward_chosen"], beta * pi_mean[:3].mean().detach())
        # ORPO: SFT on the chosen responses plus beta x the log odds ratio's term, no reference
        orpo = PostTrainModel(model_config(), "dpo", beta=beta, preference_loss="orpo")
        orpo.load_state_dict(policy.state_dict())
        got = orpo(batch)
        logp = torch.log_softmax(policy.logits(batch["tokens"][:, :-1]).float(), -1)
        picked = logp.gather(-1, batch["tokens"][:, 1:, None])[..., 0] * batch["trained"][:, 1:]
        nll = -picked[:3].sum() / tokens[:3].sum()
        mean_w, mean_l = picked[:3].sum(-1) / tokens[:3], picked[3:].sum(-1) / tokens[3:]
        log_odds = (mean_w - mean_l) - (torch.log(1 - mean_w.exp()) - torch.log(1 - mean_l.exp()))
        want = nll - beta * F.logsigmoid(log_odds).mean()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got_grad, want_grad in zip(torch.autograd.grad(got, list(orpo.parameters())),
                                       torch.autograd.grad(want, list(policy.parameters()))):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(orpo.last_metrics["nll_loss"], nll.detach())
        torch.testing.assert_close(orpo.last_metrics["dpo_loss"], want.detach() - nll.detach())  # the odds term
        torch.testing.assert_close(orpo.last_metrics["log_odds_chosen"], log_odds.mean().detach())
        torch.testing.assert_close(orpo.last_metrics["log_odds_ratio"], F.logsigmoid(log_odds).mean().detach())
        # post.sft_weight (TRL's rpo_alpha): DPO plus the chosen responses' SFT loss
        rpo = PostTrainModel(model_config(), "dpo", beta=beta, sft_weight=0.5)
        rpo.load_state_dict(policy.state_dict())
        rpo.set_reference(policy._reference[0])
        want = -F.logsigmoid(beta * h.detach()).mean() + 0.5 * nll.detach()
        torch.testing.assert_close(rpo(batch), want, rtol=1e-5, atol=1e-6)
    from posttrain.losses import log1mexp

    near_one = torch.tensor([-1e-4, -3.0, 0.0])  # log1p(-exp) keeps 3 digits of the first; p = 1 stays finite
    torch.testing.assert_close(log1mexp(near_one)[:2], torch.tensor([math.log(-math.expm1(-1e-4)),
                                                                    math.log(-math.expm1(-3.0))]))
    assert log1mexp(near_one)[2].isfinite()
    # At the start the policy is its reference: every margin is 0, and a tie is no win (as TRL counts).
    from posttrain.losses import dpo_loss

    same = torch.tensor([-4.0, -2.5])
    loss, metrics = dpo_loss(same, same - 1, same, same - 1, beta)
    assert metrics["reward_accuracy"].item() == 0.0 and loss.item() == pytest.approx(math.log(2))
    # The hinge on both sides of its margin: pairs past beta h = 1 give neither loss nor gradient
    far = torch.tensor([4.0, 1.0, -3.0], requires_grad=True)  # beta h = 2, 0.5, -1.5
    loss, _ = dpo_loss(far, torch.zeros(3), torch.zeros(3), torch.zeros(3), 0.5, "hinge")
    loss.backward()
    assert loss.item() == pytest.approx((0 + 0.5 + 2.5) / 3)
    assert far.grad.tolist() == pytest.approx([0.0, -0.5 / 3, -0.5 / 3])


def test_sga_value_head_loss_and_conditioning_text():
    from models.gpt import GPT
    from posttrain.model import PostTrainModel
    from posttrain.value_head import last_token_states

    fmt = ScoreFormat()
    messages = [{"role": "user", "content": "write about trees"}]
    conditioned = with_scores(messages, {"length": 0.5, "keyword": 1.0}, fmt)
    assert conditioned[0]["content"] == ("write about trees\nYour response must satisfy the following scores: "
                                         "<length_score:0.5> and <keyword_score:1.0>")
    assert messages[0]["content"] == "write about trees"  # the raw prompt is left as it was
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert with_scores(turns, {"length": 0.5}, fmt) == [*turns[:2], {"role": "user", "content": "c" + fmt.text(
        {"length": 0.5})}]  # the last user turn's request
    from posttrain.value_head import ValueHead

    head = ValueHead.from_spec({"hidden_size": 64, "objectives": ["a", "b"], "layers": 2, "width": 32, "dropout": 0})
    assert [tuple(m.weight.shape) for m in head.mlp if isinstance(m, torch.nn.Linear)] == [(32, 64), (32, 32), (2, 32)]
    assert ScoreFormat(item="[{name}={value}]", joiner=", ", decimals=1, prefix=" | ").text(
        {"a": 0.26, "b": 0.94}) == " | [a=0.3], [b=0.9]"

    rng = random.Random(1)
    pairs = [_pair(rng, 4, 3, 2, (0.25, 0.5)), _pair(rng, 6, 2, 5, (1.0, 0.0))]
    batch = collate_pairs(pairs, pad_id=3)
    assert batch["prompt_tokens"].shape == (2, 8) and batch["prompt_last"].tolist() == [3, 5]
    head = {"hidden_size": 64, "objectives": ["length", "keyword"], "layers": 2, "width": 32, "dropout": 0.0}
    with single_process_group():
        torch.manual_seed(4)
        model = PostTrainModel(model_config(), "sga", beta=0.1, dpo_weight=0.5, mse_weight=10.0, value_head=head)
        model.set_reference(GPT(model_config()))
        loss = model(batch)
        hidden = model.hidden_states(batch["prompt_tokens"])
        predicted = model.value_head(last_token_states(hidden, batch["prompt_last"]))
        # The last real token of each (right-padded) prompt, not the padding after it.
        alone = model.value_head(model.hidden_states(torch.tensor([pairs[0].raw_prompt]))[:, -1])
    assert predicted.shape == (2, 2) and bool(((predicted > 0) & (predicted < 1)).all())
    torch.testing.assert_close(predicted[:1], alone, rtol=1e-5, atol=1e-6)
    mse = ((predicted - batch["scores"]) ** 2).mean()
    torch.testing.assert_close(model.last_metrics["value_mse"], mse.detach())
    torch.testing.assert_close(loss, 0.5 * model.last_metrics["dpo_loss"] + 10.0 * mse, rtol=1e-5, atol=1e-6)
    # A reference other than the policy: the DPO term is not at its starting value log 2.
    assert model.last_metrics["dpo_loss"].item() != pytest.approx(math.log(2), abs=1e-4)


def test_sga_of_a_moe_model_balances_the_routers_on_both_forwards():
    from models.gpt import GPT
    from posttrain.model import PostTrainModel
    from pretrain.config import load_config

    batch = collate_pairs([_pair(random.Random(2), 4, 3, 2, (0.25, 0.5)), _pair(random.Random(3), 6, 2, 5, (1.0, 0.0))],
                          pad_id=3)
    head = {"hidden_size": 64, "objectives": ["length", "keyword"], "layers": 2, "width": 32, "dropout": 0.0}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**MODEL, **UOE, "model.moe.aux_loss_coef": 0.5}.items()]).model
    with single_process_group():
        torch.manual_seed(4)
        model = PostTrainModel(cfg, "sga", beta=0.1, dpo_weight=0.5, mse_weight=10.0, value_head=head)
        model.set_reference(GPT(cfg))
        loss = model(batch)
        without_aux = 0.5 * model.last_metrics["dpo_loss"] + 10.0 * model.last_metrics["value_mse"]
        model.predict_scores(batch["prompt_tokens"], batch["prompt_last"])
        on_prompts = model.aux_loss()
        model._logprobs(model, batch)
        on_pairs = model.aux_loss()
    assert float((on_prompts - on_pairs).detach().abs()) > 1e-4  # two different balances
    torch.testing.assert_close(loss, without_aux + (on_prompts + on_pairs) / 2, rtol=1e-5, atol=1e-6)
    # SFT of it: the loss trained on has the balance in it; ce_loss (logged) is the part val/loss compares with
    rows = collate_rows([Row(np.arange(4, 12), np.arange(8) > 3), Row(np.arange(5, 11), np.arange(6) > 2)], 3)
    with single_process_group():
        torch.manual_seed(4)
        sft = PostTrainModel(cfg, "sft")
        loss = sft(rows)
        aux, ce = sft.aux_loss(), sft.last_metrics["ce_loss"]
        sft.eval()
        with torch.no_grad():
            plain = sft(rows)
    assert float(aux.detach()) > 0
    torch.testing.assert_close(loss.detach(), ce + aux.detach())
    torch.testing.assert_close(ce, plain)


def test_throughput_counts_the_rows_a_step_runs():
    """tokens/s and MFU of post-training count the padded rows the model runs (a preference pair is
    two), not micro_batch x max_seq_len."""
    from posttrain.train import PostTrainer
    from pretrain.telemetry import Throughput

    rows = [Row(np.arange(n), np.ones(n, dtype=bool)) for n in (40, 30, 20, 10)]
    pairs = [PairExample(rows[i], rows[3 - i], np.arange(3), np.zeros(0, dtype=np.float32)) for i in range(2)]
    sft, dpo = collate_rows(rows, 0), collate_pairs(pairs, 0)
    trainer = object.__new__(PostTrainer)
    assert trainer.batch_tokens(sft) == 4 * (sft["tokens"].shape[1] - 1) < 4 * 256
    assert trainer.batch_tokens(dpo) == 4 * (dpo["tokens"].shape[1] - 1)  # chosen and rejected rows
    counted = Throughput(tokens_per_step=1024, flops_per_token=1.0, world_size=1)
    counted.step(trainer.batch_tokens(sft))
    counted.step(None)  # a step of full-length samples
    assert counted._tokens == trainer.batch_tokens(sft) + 1024


def test_validation_takes_each_example_once_at_any_layout():
    collate = lambda xs: list(xs)  # noqa: E731
    for n, micro, dp, want in ((10, 4, 1, range(10)), (10, 4, 2, range(10)), (11, 4, 2, range(10)),
                               (40, 4, 2, range(32)), (10, 3, 4, range(8))):
        ranks = [fixed_batches(list(range(n)), collate, micro, rank, dp, count=4) for rank in range(dp)]
        assert len({len(batches) for batches in ranks}) == 1, (n, micro, dp)  # as many on every rank
        assert all(len(batch) <= micro for batches in ranks for batch in batches)
        assert sorted(u for batches in ranks for batch in batches for u in batch) == list(want), (n, micro, dp)
    # rank 0's first batch, the sink metrics' probe, is the same at any data-parallel size
    assert {dp: fixed_batches(list(range(40)), collate, 4, 0, dp, count=4)[0] for dp in (1, 2, 4)} == \
        {dp: [0, 1, 2, 3] for dp in (1, 2, 4)}


def other_rank_next(units, collate, state):
    rank0 = ExampleBatches(units, collate, micro_batch=3, dp_rank=0, dp_size=2, seed=5)
    rank0.load_state_dict(state)
    return next(rank0)


def test_batches_resume_at_the_next_micro_batch():
    units = list(range(23))
    collate = lambda xs: torch.tensor(xs)  # noqa: E731
    run = ExampleBatches(units, collate, micro_batch=3, dp_rank=1, dp_size=2, seed=5)
    first = [next(run) for _ in range(7)]  # 3 per epoch: crosses into the third epoch
    state = run.state_dict()
    later = [next(run) for _ in range(4)]
    resumed = ExampleBatches(units, collate, micro_batch=3, dp_rank=1, dp_size=2, seed=5)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(later, [next(resumed) for _ in range(4)]))
    # Resumed again within that epoch, from a loader that was itself resumed: still the next batch.
    again = ExampleBatches(units, collate, micro_batch=3, dp_rank=1, dp_size=2, seed=5)
    again.load_state_dict(state)
    assert torch.equal(next(again), later[0])
    twice = ExampleBatches(units, collate, micro_batch=3, dp_rank=1, dp_size=2, seed=5)
    twice.load_state_dict(again.state_dict())
    assert torch.equal(next(twice), later[1])
    # The two ranks of a round take distinct examples, and an epoch visits 18 of the 23 once.
    # Another layout with the same global batch (6 x 1 rank) continues with the same examples.
    single = ExampleBatches(units, collate, micro_batch=6, dp_rank=0, dp_size=1, seed=5)
    single.load_state_dict(state)
    assert torch.equal(next(single), torch.cat([other_rank_next(units, collate, state), later[0]]))
    with pytest.raises(ValueError, match="examples"):
        ExampleBatches(units[:-1], collate, 3, 1, 2, 5).load_state_dict(state)
    # A micro-batch that does not divide the examples consumed (6) still continues at the next one:
    # 4 ranks of 4 take the rest of the epoch's order, none repeated, none left out.
    order = np.random.default_rng([5, state["epoch"]]).permutation(len(units))
    ranks = [ExampleBatches(units, collate, micro_batch=4, dp_rank=r, dp_size=4, seed=5) for r in range(4)]
    for rank in ranks:
        rank.load_state_dict(state)
    assert torch.cat([next(rank) for rank in ranks]).tolist() == order[6:22].tolist()
    following = np.random.default_rng([5, state["epoch"] + 1]).permutation(len(units))
    assert next(ranks[1]).tolist() == following[4:8].tolist()  # then the next epoch, from its start
    other = ExampleBatches(units, collate, micro_batch=3, dp_rank=0, dp_size=2, seed=5)
    epoch = torch.cat([next(other) for _ in range(3)] + first[:3])
    assert len(set(epoch.tolist())) == 18
    assert not torch.equal(first[0], first[3])  # a new order each epoch


def test_predictions_snap_only_to_a_scale():
    """Ratings / 4 are a scale; a continuous objective (HH-RLHF's sigmoid of rewards) is none, even
    where a small set holds few distinct values."""
    from types import SimpleNamespace

    from posttrain.examples import Examples

    def levels(*columns):
        units = [SimpleNamespace(scores=np.array(row, dtype=np.float32)) for row in zip(*columns)]
        return Examples.score_levels(SimpleNamespace(objectives=["a", "b"], units=units))

    assert levels([0.25, 1.0, 0.5, 0.25], [0.0, 1.0, 1.0, 0.0]) == {"a": [0.25, 0.5, 1.0], "b": [0.0, 1.0]}
    assert levels([0.09, 0.13, 0.65, 0.9], [0.2, 0.4, 0.6, 0.8]) == {"b": [0.2, 0.4, 0.6, 0.8]}


def test_config_errors_name_the_key(files):
    from posttrain.chat import ScoreFormat
    from posttrain.config import PostTrainConfig, validate_post
    from pretrain.config import load_config

    def check(*overrides):
        cfg = load_config(None, [f"post.data={files / 'pref.jsonl'}", *overrides], PostTrainConfig)
        with pytest.raises(ConfigError) as err:
            validate_post(cfg)
        return str(err.value)

    assert "train.init_from" in check()
    assert "post.packing" in check(f"train.init_from={files / 'init.pt'}", "post.method=dpo", "post.packing=true")
    assert "post.method" in check(f"train.init_from={files / 'init.pt'}", "post.method=ppo")
    assert "choose one of sigmoid, ipo, hinge, simpo, orpo" in check(f"train.init_from={files / 'init.pt'}",
                                                               "post.preference_loss=kto")
    assert "are for post.method=dpo or sga" in check(f"train.init_from={files / 'init.pt'}", "post.method=sft",
                                                     "post.preference_loss=simpo")
    assert "must be >= 0" in check(f"train.init_from={files / 'init.pt'}", "post.method=dpo", "post.sft_weight=-1")
    assert "leave post.sft_weight out" in check(f"train.init_from={files / 'init.pt'}", "post.method=sft",
                                                "post.sft_weight=1")
    assert "orpo has its own" in check(f"train.init_from={files / 'init.pt'}", "post.method=dpo",
                                       "post.preference_loss=orpo", "post.sft_weight=1")
    assert "post.simpo_gamma=1.0 is for post.preference_loss=simpo" in check(
        f"train.init_from={files / 'init.pt'}", "post.method=dpo", "post.simpo_gamma=1.0")
    assert "is for post.preference_loss=sigmoid or simpo" in check(f"train.init_from={files / 'init.pt'}",
                                                           "post.preference_loss=ipo", "post.label_smoothing=0.1")
    assert "must be in [0, 0.5)" in check(f"train.init_from={files / 'init.pt'}", "post.label_smoothing=0.5")
    assert "sample with python -m tools.generate" in check(f"train.init_from={files / 'init.pt'}",
                                                           "eval.sample_prompts=[hi]")
    assert "choose one of drop, keep_start, keep_end" in check(f"train.init_from={files / 'init.pt'}",
                                                               "post.sft_truncation=keep")
    assert "post.sft_truncation=keep_end is for post.method=sft" in check(
        f"train.init_from={files / 'init.pt'}", "post.method=dpo", "post.sft_truncation=keep_end")
    assert "cut by post.sft_truncation" in check(f"train.init_from={files / 'init.pt'}", "post.max_prompt_len=8")
    assert "below post.max_len (or model.max_seq_len: 16)" in check(f"train.init_from={files / 'init.pt'}",
                                                                    "post.method=dpo", "post.max_len=16",
                                                                    "post.max_prompt_len=16")
    assert "{value}" in check(f"train.init_from={files / 'init.pt'}", "post.score_item=<{score}>")
    assert "{value}" in check(f"train.init_from={files / 'init.pt'}", "post.score_item=<{name}_score>")
    # The authors' HH-RLHF text, two decimals always: a format spec is taken.
    spec = load_config(None, [f"post.data={files / 'pref.jsonl'}", f"train.init_from={files / 'init.pt'}",
                              "post.score_item=<{name}_score:{value:.2f}>"], PostTrainConfig)
    validate_post(spec)
    assert ScoreFormat.from_config(spec.post).text({"harmless": 0.5}).endswith("<harmless_score:0.50>")
    assert "post.add_bos=true" in check(f"train.init_from={files / 'init.pt'}", "data.start_with_bos=true")
    assert "normalizer=seqlen" in check(f"train.init_from={files / 'init.pt'}", "model.attention=sr",
                                        "model.relu_attention.normalizer=seqlen")
    assert "set model.moe.capacity_factor=0" in check(f"train.init_from={files / 'init.pt'}", "post.method=dpo",
                                                      "model.mlp=uoe", "model.moe.capacity_factor=1.25")


def test_a_bf16_reference_model_keeps_its_buffers_in_fp32(files):
    """DPO's frozen reference in bf16 runs as DeepSpeed runs the policy: its parameters rounded, its
    RoPE tables (and routers' selection bias) in fp32."""
    from posttrain.config import PostTrainConfig
    from posttrain.train import PostTrainTask
    from pretrain.config import load_config

    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + ["post.method=dpo", "train.precision=bf16"],
                      PostTrainConfig)
    task = PostTrainTask()
    task.reference = files / "init.pt"
    with single_process_group():
        reference = task.build_model(cfg)._reference[0]
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    buffers = dict(reference.named_buffers())
    assert buffers and {b.dtype for b in buffers.values() if b.is_floating_point()} == {torch.float32}


def test_check_refuses_a_pretraining_run_dir_and_an_unusable_val_set_and_records_bos(files, tok_dir, tmp_path):
    from posttrain.config import PostTrainConfig
    from posttrain.train import PostTrainTask
    from pretrain.checkpoint import save_weights_run
    from pretrain.checkpoint_format import COMPLETE
    from pretrain.config import load_config

    base = [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}", f"post.data={files / 'sft.jsonl'}",
                                                     f"train.init_from={files / 'init.pt'}"]

    def check(*extra):
        cfg = load_config(None, base + list(extra), PostTrainConfig)
        return cfg, PostTrainTask().check(cfg, 1)

    with pytest.raises(ConfigError, match="data.tokenizer is empty .* the model was trained with"):
        check(f"run.dir={tmp_path / 'none'}", "data.tokenizer=")
    cfg, meta = check(f"run.dir={tmp_path / 'bos'}", "post.add_bos=true")
    assert cfg.data.start_with_bos and meta["bos_id"] == 1  # what generate, evaluate and export read
    assert "bos_id" not in check(f"run.dir={tmp_path / 'plain'}")[1]
    (tmp_path / "bad.jsonl").write_text("{broken\n")
    with pytest.raises(ConfigError, match="post.val_data=.* holds no usable sft example"):
        check(f"run.dir={tmp_path / 'val'}", f"post.val_data={tmp_path / 'bad.jsonl'}")
    (tmp_path / "one.jsonl").write_text((files / "sft.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="post.val_data has 1 usable examples, fewer than the 2 data-parallel"):
        PostTrainTask().check(load_config(None, base + [f"run.dir={tmp_path / 'val'}",
                                                        f"post.val_data={tmp_path / 'one.jsonl'}"], PostTrainConfig), 2)
    (tmp_path / "short.jsonl").write_text((json.dumps({"prompt": WORDS[0], "response": WORDS[1]}) + "\n") * 3)
    with pytest.raises(ConfigError, match=r"post.val_data has 3 usable examples, packed \(post.packing\) into 1 rows, "
                                          r"fewer than the 2 .* \(or set post.packing=false\)"):
        PostTrainTask().check(load_config(None, base + [f"run.dir={tmp_path / 'val'}", "post.packing=true",
                                                        f"post.val_data={tmp_path / 'short.jsonl'}"], PostTrainConfig), 2)
    pretrained = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}"])
    with single_process_group():
        tag = save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "pretrained", {})
    # A model pretrained (or imported) with data.start_with_bos: its examples begin with BOS too.
    pretrained.data.start_with_bos = True
    with single_process_group():
        bos_tag = save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "bos_pretrained", {})
    task = PostTrainTask()
    cfg = load_config(None, base + [f"run.dir={tmp_path / 'from_bos'}", f"train.init_from={bos_tag}"], PostTrainConfig)
    assert task.check(cfg, 1)["bos_id"] == 1 and cfg.post.add_bos and cfg.data.start_with_bos
    assert task.start_notes == ["post.add_bos=True: the start checkpoint's run began its samples with BOS "
                               "(data.start_with_bos)"]
    assert task.train_data.units[0].ids[0] == 1
    # A resume draws the examples in the order of the run's own train.seed, or not at all.
    with single_process_group():
        save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "seeded", {"posttrain": {"data_seed": 7}})
    with pytest.raises(ConfigError, match=r"set train.seed=7, or start a new run.dir"):
        check(f"run.dir={tmp_path / 'seeded'}")
    # ... and with the method it was training with, named when it is not.
    with single_process_group():
        save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "dpo_run", {"posttrain": {"method": "dpo"}})
    with pytest.raises(ConfigError, match=r"post.method=sft: the run in .* is a dpo run; set post.method=dpo"):
        check(f"run.dir={tmp_path / 'dpo_run'}")
    with single_process_group():
        save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "sft_run", {"posttrain": {"method": "sft"}})
    with pytest.raises(ConfigError, match=r"post.method=dpo: the run in .* is a sft run"):  # before its data is read
        check(f"run.dir={tmp_path / 'sft_run'}", "post.method=dpo")
    # Packed, the count is of rows: the message says how many examples they hold.
    task = PostTrainTask()  # the counts of both files go into the checkpoint marker
    counted = load_config(None, base + [f"run.dir={tmp_path / 'counted'}", f"post.val_data={files / 'sft.jsonl'}",
                                        "post.packing=true"], PostTrainConfig)
    task.check(counted, 1)
    info = task.meta(counted)["posttrain"]
    assert info["examples"] == 24 == info["val"]["examples"] and info["val"]["bad_records"]["count"] == 1
    assert info["packed_rows"] == len(task.train_data.units) < 24
    with pytest.raises(ConfigError, match=r"post.data has 24 usable examples, packed \(post.packing\) into \d+ "
                                          r"rows, fewer than one micro-batch .*post.packing=false\) \(0 too long"):
        check(f"run.dir={tmp_path / 'packed'}", "post.packing=true", "train.micro_batch=24")
    marker = json.loads((tag / COMPLETE).read_text())
    check(f"run.dir={tmp_path / 'pretrained'}")  # weights without an optimizer (a pruned model) resume
    (tag / COMPLETE).write_text(json.dumps({k: v for k, v in marker.items() if k != "optimizer_state"}))
    with pytest.raises(ConfigError, match="holds a pretraining run .*train.init_from"):
        check(f"run.dir={tmp_path / 'pretrained'}")


def test_dpo_after_sft_renders_examples_in_the_format_sft_was_trained_with(files, tok_dir, tmp_path):
    """Chat keys left at their defaults take the start checkpoint's format (its posttrain meta), which
    the new run records; a key set otherwise stays, and is reported as differing."""
    from data_prep.tokenizer import load_tokenizer
    from posttrain.chat import ChatFormat
    from posttrain.config import PostTrainConfig
    from posttrain.train import PostTrainTask
    from pretrain.checkpoint import save_weights_run
    from pretrain.config import load_config

    sft = {**ChatFormat().__dict__, "user_prefix": "Human: ", "turn_end": "\n\n", "assistant_prefix": "AI: "}
    pretrained = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}"])
    with single_process_group():
        tag = save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "sft",
                               {"posttrain": {"chat": sft}})
    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [
        f"data.tokenizer={tok_dir}", f"post.data={files / 'pref.jsonl'}", "post.method=dpo",
        f"train.init_from={tag}", f"run.dir={tmp_path / 'dpo'}", "post.assistant_prefix=Bot: "],
        PostTrainConfig)
    task = PostTrainTask()
    task.check(cfg, 1)
    chat = task.meta(cfg)["posttrain"]["chat"]
    assert chat == {**sft, "assistant_prefix": "Bot: "}  # as trained, but for the key set here
    assert task.start_notes == ["post.user_prefix='Human: ': the start checkpoint's chat format",
                               "post.assistant_prefix='Bot: ' differs from the start checkpoint's 'AI: ', "
                               "the chat format it was trained with",
                               "post.turn_end='\\n\\n': the start checkpoint's chat format"]
    sp, _ = load_tokenizer(tok_dir)
    assert "Human: " in sp.decode(task.train_data.units[0].chosen.ids.tolist())
    # Weights written by tools.consolidate carry the format (and the run's BOS) too.
    from tools.consolidate import main as consolidate

    assert consolidate(["--checkpoint", str(tag), "--out", str(tmp_path / "sft.pt")]) == 0
    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [
        f"data.tokenizer={tok_dir}", f"post.data={files / 'pref.jsonl'}", "post.method=dpo",
        f"train.init_from={tmp_path / 'sft.pt'}", f"run.dir={tmp_path / 'dpo_file'}"], PostTrainConfig)
    task = PostTrainTask()
    task.check(cfg, 1)
    assert task.meta(cfg)["posttrain"]["chat"] == sft


def test_sga_after_sga_takes_the_score_format_and_the_value_head_shape(files, tok_dir, tmp_path):
    """SGA from an SGA checkpoint goes on with its value head: the score text and the head's shape
    left at their defaults are the checkpoint's, and a head shape set otherwise is refused before
    anything is built."""
    from models.config import ConfigError
    from posttrain.chat import ChatFormat
    from posttrain.config import PostTrainConfig
    from posttrain.train import PostTrainTask
    from pretrain.checkpoint import save_weights_run
    from pretrain.config import load_config

    scores = {"prefix": "\nTargets: ", "item": "[{name}={value}]", "joiner": ", ", "decimals": 2}
    head = {"hidden_size": int(MODEL["model.hidden_size"]), "objectives": ["length", "keyword"], "layers": 1,
            "width": 16, "dropout": 0.0}
    pretrained = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}"])
    with single_process_group():
        tag = save_weights_run(build_gpt(pretrained.model), pretrained, tmp_path / "sga",
                               {"posttrain": {"chat": ChatFormat().__dict__, "scores": scores, "value_head": head}})
    args = [f"{k}={v}" for k, v in MODEL.items()] + [
        f"data.tokenizer={tok_dir}", f"post.data={files / 'pref.jsonl'}", "post.method=sga",
        f"train.init_from={tag}", f"run.dir={tmp_path / 'again'}"]
    task = PostTrainTask()
    cfg = load_config(None, args, PostTrainConfig)
    task.check(cfg, 1)
    meta = task.meta(cfg)["posttrain"]
    assert meta["scores"] == scores and meta["value_head"] == {**head, "dropout": 0.1}  # a setting, not the shape
    from data_prep.tokenizer import load_tokenizer

    assert "Targets: [length=" in load_tokenizer(tok_dir)[0].decode(task.train_data.units[0].chosen.ids.tolist())
    with pytest.raises(ConfigError, match=r"post.value_head_width=32 \(the head's 16\): SGA goes on with the value "
                                          "head of"):
        PostTrainTask().check(load_config(None, args + ["post.value_head_width=32"], PostTrainConfig), 1)
    # From the weights alone (tools.consolidate): a new head, on the score text the model learned.
    from tools.consolidate import main as consolidate

    assert consolidate(["--checkpoint", str(tag), "--out", str(tmp_path / "sga.pt")]) == 0
    cfg = load_config(None, [*args[:-2], f"train.init_from={tmp_path / 'sga.pt'}", f"run.dir={tmp_path / 'new_head'}"],
                      PostTrainConfig)
    task = PostTrainTask()
    task.check(cfg, 1)
    meta = task.meta(cfg)["posttrain"]
    assert meta["scores"] == scores and meta["value_head"]["width"] == 1024


def build_gpt(cfg):
    from models.gpt import GPT

    torch.manual_seed(0)
    return GPT(cfg)


# ---- converters


def test_helpsteer2_pairs_ties_and_bad_rows(tmp_path):
    rows = [
        {"prompt": "A", "response": "a-mid", "helpfulness": 2, "correctness": 2, "coherence": 2, "complexity": 2,
         "verbosity": 2},
        {"prompt": "A", "response": "a-best", "helpfulness": 4, "correctness": 4, "coherence": 4, "complexity": 1,
         "verbosity": 3},
        {"prompt": "A", "response": "a-worst", "helpfulness": 0, "correctness": 1, "coherence": 2, "complexity": 1,
         "verbosity": 1},
        {"prompt": "B", "response": "b1", "helpfulness": 3, "correctness": 3, "coherence": 3, "complexity": 3,
         "verbosity": 3},
        {"prompt": "B", "response": "b2", "helpfulness": 3, "correctness": 3, "coherence": 3, "complexity": 3,
         "verbosity": 3},
        {"prompt": "C", "response": "only", "helpfulness": 3, "correctness": 3, "coherence": 3, "complexity": 3,
         "verbosity": 3},
        {"prompt": "A", "response": "bad", "helpfulness": "x", "correctness": 3, "coherence": 3, "complexity": 3,
         "verbosity": 3},
        {"prompt": "A", "response": "too high", "helpfulness": 5, "correctness": 3, "coherence": 3,
         "complexity": 3, "verbosity": 3},
        {"prompt": "A", "response": "huge", "helpfulness": 10**400, "correctness": 3, "coherence": 3,
         "complexity": 3, "verbosity": 3},  # valid JSON, too large for a float
        {"prompt": "Hi<extra_id_1>Assistant\nHello!<extra_id_1>User\nTell me more", "response": "m1",
         "helpfulness": 4, "correctness": 4, "coherence": 4, "complexity": 2, "verbosity": 2},
        {"prompt": "Hi<extra_id_1>Assistant\nHello!<extra_id_1>User\nTell me more", "response": "m2",
         "helpfulness": 1, "correctness": 1, "coherence": 4, "complexity": 2, "verbosity": 2},
    ]
    src = tmp_path / "hs2.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    result = convert("helpsteer2", [str(src)], tmp_path / "out.jsonl")
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert result["pairs"] == 2 and result["ties"] == 1 and result["single_response"] == 1
    assert result["bad"]["count"] == 4  # non-numeric, out of range, too large, malformed JSON
    from posttrain.records import BadRecord, scored_preference

    with pytest.raises(BadRecord, match=r"scores\['h'\]=.* is not a number in \[0, 1\]"):
        scored_preference({"prompt": "p", "chosen": "a", "rejected": "b", "scores": {"h": 10**400}})
    first = out[0]
    assert (first["prompt"], first["chosen"], first["rejected"]) == ("A", "a-best", "a-worst")
    assert first["scores"] == {"helpfulness": 1.0, "correctness": 1.0, "coherence": 1.0, "complexity": 0.25,
                               "verbosity": 0.75}
    assert out[1]["prompt"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "Tell me more"}]
    with pytest.raises(FileExistsError):
        convert("helpsteer2", [str(src)], tmp_path / "out.jsonl")


def test_hh_rlhf_dialogues_split_into_prompt_turns_and_responses(tmp_path, capsys):
    from posttrain.convert import main
    from posttrain.records import Pair, preference

    talk = "\n\nHuman: Hi?\n\nAssistant: Hello.\n\nHuman: Cats or dogs?\n\nAssistant:"
    rows = [{"chosen": talk + " Both.\n\nThey differ.", "rejected": talk + " Dogs."},
            {"chosen": "Human: One turn?\n\nAssistant: Yes.", "rejected": "Human: One turn?\n\nAssistant: No."},
            {"chosen": talk + " Same.", "rejected": talk + " Same."},  # prefers neither: dropped
            {"chosen": talk + " Both.", "rejected": "\n\nHuman: Hi?\n\nAssistant: Hey.\n\nHuman: Cats or dogs?"
                                                   "\n\nAssistant: Dogs."},  # differ before the last turn
            {"chosen": talk + " Both.", "rejected": talk},  # an empty response
            {"chosen": "Hi?\n\nAssistant: Yes.", "rejected": "Hi?\n\nAssistant: No."},  # no Human mark
            {"chosen": talk + " Both.\n\nHuman: Ok.", "rejected": talk + " Dogs.\n\nHuman: Ok."},
            {"chosen": "\n\nHuman: A\n\nAssistant: B\n\nAssistant: C", "rejected": "\n\nHuman: A\n\n"
                                                                                    "Assistant: B\n\nAssistant: D"},
            {"chosen": "\n\nHuman: Code?\n\nAssistant:\n\nHuman: Please?\n\nAssistant:    x = 1\n    y = 2 ",
             "rejected": "\n\nHuman: Code?\n\nAssistant:\n\nHuman: Please?\n\nAssistant: No."}]
    src, out = tmp_path / "hh.jsonl", tmp_path / "hh_pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["hh-rlhf", "--input", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 3 pairs" in printed and "dropped 1 rows with the same response twice and 1 empty turns" in printed
    assert "bad inputs: 5 skipped" in printed, printed
    pairs = [preference(json.loads(line)) for line in out.read_text().splitlines()]
    user, assistant = (lambda text: {"role": "user", "content": text}), \
        (lambda text: {"role": "assistant", "content": text})
    assert pairs == [Pair([user("Hi?"), assistant("Hello."), user("Cats or dogs?")], "Both.\n\nThey differ.",
                          "Dogs.", {}),
                     Pair([user("One turn?")], "Yes.", "No.", {}),
                     Pair([user("Code?"), user("Please?")], "   x = 1\n    y = 2", "No.", {})]  # indentation kept


def test_trl_s_conversational_preference_records_give_the_pair_of_the_plain_shape():
    """chosen / rejected as messages, after the prompt's turns or alone, with an explicit prompt or
    TRL's implicit one (the turns both responses follow), as HF preference datasets hold them."""
    from posttrain.records import BadRecord, Pair, preference

    user = {"role": "user", "content": "Hi?"}
    good, bad = {"role": "assistant", "content": "Hello."}, {"role": "assistant", "content": "Go."}
    plain = preference({"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."})
    assert plain == Pair([user], "Hello.", "Go.", {})
    for rec in ({"chosen": [user, good], "rejected": [user, bad]},  # implicit prompt
                {"prompt": [user], "chosen": [good], "rejected": [bad]},
                {"prompt": "Hi?", "chosen": [user, good], "rejected": [user, bad]}):  # HuggingFaceH4's
        assert preference(rec) == plain, rec
    from posttrain.records import sft_messages

    for rec in ({"prompt": [user], "completion": [good]}, {"prompt": "Hi?", "completion": "Hello."}):  # TRL's SFT
        assert sft_messages(rec) == [user, good], rec
    other = {"role": "user", "content": "Bye?"}
    for rec, why in (({"chosen": [user, good], "rejected": [other, bad]}, "differ before their last turn"),
                     ({"chosen": [good], "rejected": [bad]}, "no 'prompt'"),
                     ({"prompt": "Hi?", "chosen": [other, good], "rejected": [bad]}, "turns of 'chosen' before"),
                     ({"chosen": [user, good], "rejected": [user]}, "must end with the assistant's response")):
        with pytest.raises(BadRecord, match=why):
            preference(rec)


def test_ultrafeedback_both_shapes_and_na_ratings(tmp_path):
    def completion(text, *ratings):
        aspects = ["helpfulness", "honesty", "instruction_following", "truthfulness"]
        return {"response": text, "annotations": {a: {"Rating": str(r)} for a, r in zip(aspects, ratings)}}

    nested = {"instruction": "Q1", "completions": [completion("good", 5, 5, 4, 5), completion("na", "N/A", 5, 5, 5),
                                                   completion("poor", 2, 1, 1, 2), completion("ok", 3, 3, 3, 3)]}
    flat = [dict(prompt="Q2", **completion("f-good", 4, 4, 4, 4)), dict(prompt="Q2", **completion("f-bad", 1, 1, 2, 1)),
            dict(prompt="Q3", **completion("tie1", 3, 3, 3, 3)), dict(prompt="Q3", **completion("tie2", 3, 3, 3, 3))]
    src = tmp_path / "uf.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [nested, *flat]) + "\n")
    result = convert("ultrafeedback", [str(src)], tmp_path / "uf_out.jsonl")
    out = [json.loads(line) for line in (tmp_path / "uf_out.jsonl").read_text().splitlines()]
    assert result["pairs"] == 2 and result["ties"] == 1 and result["bad"]["count"] == 1
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in out] == [("Q1", "good", "poor"), ("Q2", "f-good", "f-bad")]
    assert out[0]["scores"] == {"helpfulness": 1.0, "honesty": 1.0, "instruction_following": 0.75, "truthfulness": 1.0}
    # As a Parquet struct gives them: every field present, the unused ones null.
    nulls = {"instruction": "Q5", "prompt": None,
             "completions": [{**completion(None, 5, 5, 5, 5), "completion": "c-good"},
                             {**completion(None, 1, 1, 1, 1), "completion": "c-bad"}]}
    (tmp_path / "nulls.jsonl").write_text(json.dumps(nulls) + "\n")
    assert convert("ultrafeedback", [str(tmp_path / "nulls.jsonl")], tmp_path / "nulls_out.jsonl")["pairs"] == 1
    (pair,) = [json.loads(line) for line in (tmp_path / "nulls_out.jsonl").read_text().splitlines()]
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == ("Q5", "c-good", "c-bad")
    # completions that are not a list are counted as bad rows; a null one is the flat form's empty field
    odd = [{"instruction": "Q6", "completions": {"a": 1}}, {"instruction": "Q6", "completions": "text"},
           dict(prompt="Q7", completions=None, **completion("n-good", 5, 5, 5, 5)),
           dict(prompt="Q7", completions=None, **completion("n-bad", 1, 1, 1, 1))]
    (tmp_path / "odd.jsonl").write_text("\n".join(json.dumps(r) for r in odd) + "\n")
    result = convert("ultrafeedback", [str(tmp_path / "odd.jsonl")], tmp_path / "odd_out.jsonl")
    assert result["pairs"] == 1 and result["bad"]["count"] == 2, result
    assert "expected a list of completions" in json.dumps(result["bad"])


# ---- real runs on gloo


def post_train(nproc, files, tok_dir, run_dir, method, *extra, check=True):
    values = {**MODEL, "data.tokenizer": tok_dir, "train.init_from": files / "init.pt", "run.dir": run_dir,
              "post.method": method, "post.data": files / ("sft.jsonl" if method == "sft" else "pref.jsonl"),
              "post.val_data": files / ("sft.jsonl" if method == "sft" else "pref.jsonl"),
              "train.micro_batch": 4, "train.steps": 4, "train.warmup_steps": 1, "train.log_interval": 1,
              "train.eval_interval": 2, "train.eval_batches": 1, "train.save_interval": 2, "train.lr": 3e-3,
              "post.value_head_width": 32, "post.value_head_layers": 2}
    for item in extra:
        key, value = item.split("=", 1)
        values[key] = value
    return torchrun(nproc, ["-m", "posttrain.train", *[f"{k}={v}" for k, v in values.items()]], check=check)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]


def grad_norms(run_dir) -> list[float]:
    return [r["train/grad_norm"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/grad_norm" in r]


def validations(run_dir) -> dict[int, dict]:
    """step -> the val/ values logged at that step."""
    out: dict[int, dict] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        out.setdefault(record["step"], {}).update({k[4:]: v for k, v in record.items() if k.startswith("val/")})
    return {step: v for step, v in out.items() if v}


def test_a_resume_refuses_a_reference_that_is_gone_or_rewritten(tmp_path, files, tok_dir):
    """A DPO run measures every loss against the reference it started from: resumed after that
    checkpoint was removed or written again, it is refused, naming the reference; an SFT or SimPO
    run, which has none, resumes without its start."""
    import os
    import shutil

    from posttrain.config import PostTrainConfig
    from posttrain.train import PostTrainTask
    from pretrain.config import load_config
    from pretrain.init_from import source_fingerprint

    start, backup = tmp_path / "start.pt", tmp_path / "backup.pt"
    shutil.copy(files / "init.pt", start)
    shutil.copy(start, backup)
    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)

    def resume(method: str, *more: str) -> dict:
        (tag / "COMPLETE").write_text(json.dumps({"step": 2, "posttrain": {
            "method": method, "reference": str(start), "reference_fingerprint": fingerprint}}))
        values = {**MODEL, "data.tokenizer": tok_dir, "train.init_from": start, "run.dir": tmp_path / "run",
                  "post.method": method, "post.data": files / ("sft.jsonl" if method == "sft" else "pref.jsonl")}
        cfg = load_config(None, [f"{k}={v}" for k, v in values.items()] + list(more), PostTrainConfig)
        task = PostTrainTask()
        task.check(cfg, 1)
        return task.meta(cfg)["posttrain"]  # what the resumed run records again

    fingerprint = source_fingerprint(start)
    assert resume("dpo")["reference_fingerprint"] == fingerprint  # the reference as it was
    state = torch.load(start, weights_only=False)
    state["state_dict"] = {k: v + 1 if v.is_floating_point() else v for k, v in state["state_dict"].items()}
    torch.save(state, start)  # other weights written there since
    with pytest.raises(ConfigError, match=f"reference it started from, {start}, which holds other weights since"):
        resume("dpo")
    start.unlink()
    with pytest.raises(ConfigError, match=f"{start}, which is gone; restore it there, or start a new run.dir"):
        resume("dpo")
    shutil.copy(backup, start)  # restored: another modification time, the same weights
    os.utime(start, ns=(1, 1))
    resume("dpo")
    start.unlink()
    assert resume("sft")["reference"] == str(start)
    assert resume("dpo", "post.preference_loss=simpo")["reference"] == str(start)  # SimPO holds none


@pytest.mark.slow
def test_orpo_holds_no_reference_and_weighs_its_sft_term_by_tokens_at_any_layout(tmp_path, files, tok_dir):
    """ORPO (reference-free, with an SFT term on the chosen responses) at two data-parallel ranks
    gives one process's losses and gradient norms, and resumes with its start checkpoint gone."""
    import shutil

    start = tmp_path / "start.pt"
    shutil.copy(files / "init.pt", start)
    orpo = ("post.preference_loss=orpo", f"train.init_from={start}")
    post_train(1, files, tok_dir, tmp_path / "one", "dpo", *orpo)
    post_train(2, files, tok_dir, tmp_path / "dp2", "dpo", *orpo, "train.micro_batch=2", "train.stop_at_step=2")
    start.unlink()  # nothing reads it again: no reference model
    post_train(2, files, tok_dir, tmp_path / "dp2", "dpo", *orpo, "train.micro_batch=2", "train.resume=auto")
    one, dp2 = losses(tmp_path / "one"), losses(tmp_path / "dp2")
    assert len(one) == 4 and one[-1] < one[0]
    assert dp2 == pytest.approx(one, rel=1e-5, abs=1e-6)
    assert grad_norms(tmp_path / "dp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)


@pytest.mark.slow
def test_dpo_tensor_parallel_and_zero2_match_one_process_and_resume(tmp_path, files, tok_dir):
    single = post_train(1, files, tok_dir, tmp_path / "single", "dpo")
    # DPO reads no scores: the record whose score is out of range is a good pair here
    assert "dpo: 25 training pairs" in single.stdout and "bad inputs: none" in single.stdout
    assert "reward_accuracy" in single.stdout
    reference = losses(tmp_path / "single")
    assert reference[0] == pytest.approx(math.log(2), abs=1e-5)  # policy starts as the reference
    assert reference[-1] < reference[0] - 0.05
    post_train(2, files, tok_dir, tmp_path / "tp2", "dpo", "parallel.tensor=2")
    post_train(2, files, tok_dir, tmp_path / "zero2", "dpo", "parallel.zero_stage=2", "train.micro_batch=2")
    assert losses(tmp_path / "tp2") == pytest.approx(reference, rel=1e-4, abs=1e-5)
    assert losses(tmp_path / "zero2") == pytest.approx(reference, rel=1e-4, abs=1e-5)
    # Validation reports the pairs' rewards (averaged as the loss is), not a perplexity of a pair loss.
    val = validations(tmp_path / "single")
    assert sorted(val) == [2, 4] and "perplexity" not in val[4]
    assert val[4]["dpo_loss"] == pytest.approx(val[4]["loss"], rel=1e-6) and 0 <= val[4]["reward_accuracy"] <= 1
    assert val[4]["reward_margin"] == pytest.approx(val[4]["reward_chosen"] - val[4]["reward_rejected"], abs=1e-6)
    assert val[4]["reward_margin"] > 0  # trained on the same pairs
    assert validations(tmp_path / "tp2")[4] == pytest.approx(val[4], rel=1e-4, abs=1e-5)
    saved_run_copy(tmp_path / "single", tmp_path / "resumed", 2)  # as if stopped after step 2
    post_train(1, files, tok_dir, tmp_path / "resumed", "dpo")
    assert losses(tmp_path / "resumed") == pytest.approx(reference[2:], rel=1e-5, abs=1e-6)


UOE = {"model.mlp": "uoe", "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden_size": 48,
       "model.moe.shared_hidden_size": 32, "model.moe.routing_neurons": 8, "model.moe.aux_loss_coef": 0.0}


@pytest.mark.slow
def test_dpo_of_a_uoe_model_at_expert_parallel_2_matches_one_process(tmp_path, files, tok_dir):
    from models.gpt import GPT
    from pretrain.config import load_config

    with single_process_group():
        torch.manual_seed(0)
        model = GPT(load_config(None, [f"{k}={v}" for k, v in {**MODEL, **UOE}.items()]).model)
        torch.save({"model": model.cfg.to_dict(), "state_dict": model.state_dict()}, tmp_path / "uoe.pt")
    uoe = [f"{k}={v}" for k, v in UOE.items()] + [f"train.init_from={tmp_path / 'uoe.pt'}"]
    post_train(1, files, tok_dir, tmp_path / "one", "dpo", *uoe)
    post_train(2, files, tok_dir, tmp_path / "ep2", "dpo", *uoe, "parallel.expert=2", "train.micro_batch=2")
    reference = losses(tmp_path / "one")
    assert reference[-1] < reference[0] - 0.05
    assert losses(tmp_path / "ep2") == pytest.approx(reference, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_sft_packed_resume_reproduces_the_uninterrupted_run(tmp_path, files, tok_dir, capsys):
    whole = post_train(1, files, tok_dir, tmp_path / "whole", "sft", "post.packing=true", "train.micro_batch=2")
    assert "sft:" in whole.stdout and "1 skipped (1 malformed JSON)" in whole.stdout
    saved_run_copy(tmp_path / "whole", tmp_path / "parts", 2)  # as if stopped after step 2
    post_train(1, files, tok_dir, tmp_path / "parts", "sft", "post.packing=true", "train.micro_batch=2")
    assert losses(tmp_path / "parts") == pytest.approx(losses(tmp_path / "whole")[2:], rel=1e-5, abs=1e-6)
    val = validations(tmp_path / "whole")[4]  # SFT's loss is the responses' cross-entropy: a perplexity
    assert set(val) == {"loss", "perplexity"} and val["perplexity"] == pytest.approx(math.exp(val["loss"]))
    # The same global batch in two micro-batches (with other numbers of response tokens each): the
    # loss is the mean over the step's response tokens, not the mean of the micro-batches' means.
    post_train(1, files, tok_dir, tmp_path / "accum", "sft", "post.packing=true", "train.micro_batch=1",
               "train.grad_accum=2")
    assert losses(tmp_path / "accum") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5, abs=1e-6)
    # ... and over two data-parallel ranks: the step's response tokens counted across them, in the
    # loss, its gradients and the validation.
    post_train(2, files, tok_dir, tmp_path / "dp2", "sft", "post.packing=true", "train.micro_batch=1")
    assert losses(tmp_path / "dp2") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5, abs=1e-6)
    assert grad_norms(tmp_path / "dp2") == pytest.approx(grad_norms(tmp_path / "whole"), rel=1e-4)
    assert validations(tmp_path / "dp2")[4] == pytest.approx(val, rel=1e-5)
    # tools.generate --chat answers in the chat format the run trained with: the reference is the
    # prompt as ChatEncoder renders it, decoded greedily
    from models.generation import generate
    from pretrain.consolidate import load_model
    from tools.generate import main as generate_main

    system, message = "Be brief.", "red tree"
    assert generate_main(["--checkpoint", str(tmp_path / "whole"), "--chat", message, "--system", system,
                          "--greedy", "--max-new-tokens", "8", "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    from data_prep.tokenizer import load_tokenizer

    encoder = ChatEncoder(load_tokenizer(tok_dir)[0], ChatFormat())
    prompt = encoder.prompt([{"role": "system", "content": system}, {"role": "user", "content": message}])
    model = load_model(tmp_path / "whole")[0]
    want = generate(model, prompt, 8, greedy=True, eos_id=encoder.eos)
    assert got["prompt_ids"] == prompt and got["ids"] == want
    assert got["text"] == encoder.decode_response(want[:-1] if want[-1:] == [encoder.eos] else want)


def test_sft_of_an_expert_model_logs_the_cross_entropy_weighted_as_the_loss(tmp_path, files, tok_dir):
    """train/ce_loss (train/loss less the routers' balance loss) over two micro-batches with other
    numbers of response tokens: the mean over the step's response tokens, as train/loss, not the
    mean of the micro-batches' means (a negligible balance coefficient makes the two equal)."""
    from models.gpt import GPT
    from pretrain.config import load_config

    uoe = [f"{k}={v}" for k, v in MODEL.items()] + ["model.mlp=uoe", "model.moe.expert_hidden_size=32",
                                                   "model.moe.shared_hidden_size=32", "model.moe.aux_loss_coef=1e-12"]
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(load_config(None, uoe).model)
        torch.save({"model": model.cfg.to_dict(), "state_dict": model.state_dict()}, tmp_path / "uoe.pt")
    post_train(1, files, tok_dir, tmp_path / "run", "sft", *uoe[len(MODEL):], f"train.init_from={tmp_path / 'uoe.pt'}",
               "train.micro_batch=1", "train.grad_accum=2", "post.val_data=")
    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert len(logged) == 4
    for r in logged:
        assert r["train/ce_loss"] == pytest.approx(r["train/loss"], rel=1e-6), r["step"]


@pytest.fixture(scope="module")
def sga_run(tmp_path_factory, files, tok_dir):
    run_dir = tmp_path_factory.mktemp("sga") / "run"
    # A short score prefix: the tiny tokenizer spends ~35 tokens on the default one.
    proc = post_train(1, files, tok_dir, run_dir, "sga", "post.mse_weight=100", "post.score_prefix=\nscores: ")
    return run_dir, proc


@pytest.mark.slow
def test_sga_trains_and_two_stage_inference_prints_scores_then_text(sga_run, tok_dir, capsys):
    import subprocess
    import sys

    run_dir, proc = sga_run
    assert "objectives length, keyword" in proc.stdout and "value_mse" in proc.stdout
    from tools.generate import main as generate_main

    # an SGA model answers with its scores in the prompt
    assert generate_main(["--checkpoint", str(run_dir), "--chat", "red tree", "--device", "cpu"]) == 2
    assert "python -m tools.sga_generate" in capsys.readouterr().err
    assert "1 skipped" in proc.stdout  # the record whose score is outside [0, 1]

    def generate(*args):
        cmd = [sys.executable, "-m", "tools.sga_generate", "--checkpoint", str(run_dir), "--prompt", "red tree",
               "--max-new-tokens", "5", "--greedy", *args]
        done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    text = generate()
    assert text.splitlines()[0].startswith("predicted scores: length ") and ", keyword " in text.splitlines()[0]
    # Trained on length 0.25 ... 1 and keyword 1 alone: predictions are snapped to those levels.
    used = text.splitlines()[1]
    assert used.startswith("used scores: length ") and used.endswith("keyword 1.000")
    result = json.loads(generate("--json", "--scores", "keyword=0.25"))
    assert sorted(result["predicted_scores"]) == ["keyword", "length"]
    assert all(0 < v < 1 for v in result["predicted_scores"].values())
    length = result["predicted_scores"]["length"]
    snapped = min((0.25, 0.5, 0.75, 1.0), key=lambda level: abs(level - length))
    assert result["scores"] == {"length": snapped, "keyword": 0.25}
    assert result["conditioning"] == f"\nscores: <length_score:{snapped}> and <keyword_score:0.25>"
    assert 1 <= len(result["ids"]) <= 5
    # A prompt longer than max_seq_len: both stages read its last max_seq_len tokens; --no-snap
    # conditions on the predictions as they are.
    long = json.loads(generate("--json", "--no-snap", "--prompt", "red tree " * 200))
    assert sorted(long["predicted_scores"]) == ["keyword", "length"] and 1 <= len(long["ids"]) <= 5
    predicted = {name: round(value, 2) for name, value in long["predicted_scores"].items()}
    assert long["scores"] == long["predicted_scores"] and long["conditioning"] == \
        f"\nscores: <length_score:{predicted['length']}> and <keyword_score:{predicted['keyword']}>"


@pytest.mark.slow
def test_sga_export_writes_the_value_head_beside_the_model(sga_run, tmp_path, tok_dir):
    from safetensors.torch import load_file

    from data_prep.tokenizer import load_tokenizer
    from posttrain.inference import SGAModel
    from posttrain.value_head import ValueHead
    from tools.export import export

    run_dir, _ = sga_run
    out = export(str(run_dir), tmp_path / "hf")
    # The chat format the model learnt: recorded, and the tokenizer's chat template.
    assert json.loads((out / "export_info.json").read_text())["chat"]["assistant_prefix"] == "Assistant: "
    assert "Assistant:" in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    info = json.loads((out / "value_head.json").read_text())
    assert info["value_head"]["objectives"] == ["length", "keyword"] and info["scores"]["decimals"] == 2
    assert info["score_levels"] == {"length": [0.25, 0.5, 0.75, 1.0], "keyword": [1.0]}  # to snap predictions to
    head = ValueHead.from_spec(info["value_head"])
    head.load_state_dict(load_file(str(out / "value_head.safetensors")))
    with single_process_group():
        sga = SGAModel.load(run_dir, load_tokenizer(tok_dir)[0])
    for a, b in zip(head.state_dict().values(), sga.value_head.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_launchers_start_post_training(files, tok_dir, capsys, monkeypatch, tmp_path):
    import yaml

    from launch import local, submit

    monkeypatch.chdir(tmp_path)  # relative paths are resolved against the submitting directory
    (tmp_path / "pref.jsonl").write_text((files / "pref.jsonl").read_text())
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump({"model": {k.split(".")[1]: v for k, v in MODEL.items()},
                                      "post": {"method": "dpo", "data": ["pref.jsonl"]}}))
    overrides = [f"data.tokenizer={tok_dir}", f"train.init_from={files / 'init.pt'}", "run.dir=runs/dpo"]
    assert local.main([str(config), "--post", "--nproc", "2", "--dry-run", *overrides]) == 0
    assert "-m posttrain.train --config" in capsys.readouterr().out
    assert submit.main([str(config), "--post", "--nodes", "1", "--cpu-procs-per-node", "2", "--time", "00:10:00",
                        "--dry-run", *overrides]) == 0
    script, job_config = capsys.readouterr().out.split("slurm_config.yaml\n")[-2:]
    assert '-m posttrain.train --config "$CONFIG"' in script
    assert yaml.safe_load(job_config)["post"]["data"] == [str(tmp_path / "pref.jsonl")]
    # Without --post the launcher checks a pretraining config, which has no `post` section.
    assert local.main([str(config), "--dry-run", *overrides]) == 2
    assert "the post section sets post-training, which runs with python -m posttrain.train" in capsys.readouterr().err


def test_sga_objectives_keep_the_starting_checkpoints_order(files, encoder, tmp_path):
    from posttrain.config import PostTrainConfig
    from posttrain.examples import Examples
    from pretrain.config import load_config

    data = tmp_path / "mixed.jsonl"
    rows = [json.loads(line) for line in (files / "pref.jsonl").read_text().splitlines()[:4]]
    rows[1]["scores"] = {"keyword": 0.5, "length": 0.25}  # the same objectives in another order
    rows[2]["scores"] = {"length": 0.5}  # one missing
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + ["post.method=sga", "post.score_prefix=\nscores: "],
                      PostTrainConfig)
    ordered = Examples(cfg, [str(data)], encoder, ["keyword", "length"])
    assert ordered.objectives == ["keyword", "length"] and len(ordered.units) == 3
    assert ordered.units[1].scores.tolist() == [0.5, 0.25]
    assert ordered.units[0].scores.tolist() == [rows[0]["scores"]["keyword"], rows[0]["scores"]["length"]]
    assert ordered.report.count == 1 and "not the objectives" in ordered.report.examples[0]
    # The pairs the policy is trained on carry the scores; the value head's raw prompt does not.
    unit, sp = ordered.units[1], encoder.sp
    assert "scores: <keyword_score:0.5> and <length_score:0.25>" in sp.decode(unit.chosen.ids.tolist())
    assert "scores:" not in sp.decode(unit.raw_prompt) and len(unit.raw_prompt) < len(unit.chosen.ids)
    first = Examples(cfg, [str(data)], encoder, None)  # without a checkpoint's: the first record's order
    assert first.objectives == ["length", "keyword"] and first.fingerprint() != ordered.fingerprint()


def test_examples_longer_than_a_row_are_counted_and_left_out(files, encoder, tmp_path):
    """A pair whose rejected side alone is too long, and SFT conversations one token either side of
    the limit (sequence length + 1 tokens per row)."""
    from posttrain.config import PostTrainConfig
    from posttrain.examples import Examples, example_length
    from pretrain.config import load_config

    dpo = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + ["post.method=dpo"], PostTrainConfig)
    limit = example_length(dpo)
    pair = json.loads((files / "pref.jsonl").read_text().splitlines()[0])
    long_rejected = {**pair, "rejected": " ".join(["word"] * 4 * limit)}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps(long_rejected) + "\n")
    got = Examples(dpo, [str(tmp_path / "pairs.jsonl")], encoder, None)
    assert (len(got.units), got.too_long) == (1, 1)
    # post.max_prompt_len: cut to fit instead, as TRL truncates: the prompt's last tokens, then the
    # responses' first (a long prompt too)
    long_prompt = {**pair, "prompt": " ".join(["ask"] * 4 * limit) + " " + pair["prompt"]}
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in (pair, long_rejected, long_prompt)))
    cut = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + ["post.method=dpo", "post.max_prompt_len=10"],
                      PostTrainConfig)
    got = Examples(cut, [str(tmp_path / "pairs.jsonl")], encoder, None)
    assert (len(got.units), got.too_long, got.truncated) == (3, 0, 2)
    from posttrain.records import prompt_messages

    whole, short_prompt = (encoder.prompt(prompt_messages(p["prompt"])) for p in (pair, long_prompt))
    short_response = encoder.response(long_rejected["rejected"])
    assert got.units[0].chosen.ids.tolist() == whole + encoder.response(pair["chosen"])  # fits: as it was
    rejected = got.units[1].rejected
    assert len(rejected.ids) == limit and rejected.ids.tolist() == (whole[-10:] + short_response)[:limit]
    assert got.units[2].raw_prompt == short_prompt[-10:] and got.units[2].chosen.ids[:10].tolist() == short_prompt[-10:]
    # SGA: the scores at the conditioned prompt's end stay whole, with some of the conversation (the
    # raw prompt keeps the same), or the pair is dropped
    from posttrain.chat import ScoreFormat, with_scores

    scores = {"length": 0.5, "keyword": 1.0}
    (tmp_path / "sga.jsonl").write_text(json.dumps({**long_prompt, "scores": scores}) + "\n")

    def sga(max_prompt_len: int):
        sga_cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()]
                              + ["model.max_seq_len=256", "post.method=sga", f"post.max_prompt_len={max_prompt_len}"],
                              PostTrainConfig)
        conditioned = encoder.prompt(with_scores(prompt_messages(long_prompt["prompt"]), scores,
                                                 ScoreFormat.from_config(sga_cfg.post)))
        return Examples(sga_cfg, [str(tmp_path / "sga.jsonl")], encoder, None), conditioned

    _, conditioned = sga(40)
    common = next(i for i, (a, b) in enumerate(zip(conditioned, short_prompt)) if a != b)
    tail, extra = len(conditioned) - common, len(conditioned) - len(short_prompt)  # scores onwards; scores
    assert 0 < extra < tail < 200
    tight, _ = sga(tail)  # no room for the conversation: dropped
    assert (len(tight.units), tight.too_long) == (0, 1)
    roomy, _ = sga(tail + 4)
    unit = roomy.units[0]
    assert unit.chosen.ids[:tail + 4].tolist() == conditioned[-(tail + 4):]
    assert unit.raw_prompt == short_prompt[-(tail + 4 - extra):]

    sft = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + ["post.method=sft"], PostTrainConfig)
    prompt = [{"role": "user", "content": "say"}]
    base = len(encoder.conversation([*prompt, {"role": "assistant", "content": ""}])[0])
    records, lengths = [], []
    for words in range(1, 4 * limit):
        messages = [*prompt, {"role": "assistant", "content": " ".join(["a"] * words)}]
        lengths.append(len(encoder.conversation(messages)[0]))
        records.append({"messages": messages})
        if lengths[-1] > limit + 1:
            break
    assert base <= limit and limit in lengths  # one exactly at the limit (kept) and longer ones
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = Examples(sft, [str(tmp_path / "sft.jsonl")], encoder, None)
    assert (got.examples, got.too_long) == (sum(n <= limit for n in lengths), sum(n > limit for n in lengths))


def test_sft_truncation_keeps_the_first_or_the_last_tokens_with_their_masks(encoder, tok_dir, tmp_path):
    from data_prep.tokenizer import load_tokenizer
    from posttrain.config import PostTrainConfig
    from posttrain.examples import Examples, example_length
    from pretrain.config import load_config

    user, assistant = {"role": "user", "content": " ".join(WORDS)}, {"role": "assistant", "content": " ".join(WORDS * 2)}
    long_talk = {"messages": [user, assistant, user, assistant]}  # two trained turns, longer than a row
    long_question = {"messages": [{**user, "content": " ".join(WORDS * 3)}, {**assistant, "content": "yes"}]}
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (long_talk, long_question)))

    def examples(mode: str, *more: str, chat=encoder):
        cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"post.sft_truncation={mode}", *more],
                          PostTrainConfig)
        return Examples(cfg, [str(data)], chat, None), example_length(cfg)

    got, limit = examples("drop")
    assert (got.examples, got.too_long, got.truncated) == (0, 2, 0)
    ids, trained = encoder.conversation(long_talk["messages"])
    question_ids, question_trained = encoder.conversation(long_question["messages"])
    assert len(ids) > limit and len(question_ids) > limit and question_trained[:-limit].sum() == 0
    got, _ = examples("keep_start")  # the question alone fills the row: nothing to train, dropped
    assert (got.examples, got.too_long, got.truncated) == (1, 1, 1)
    row = got.units[0]
    assert row.ids.tolist() == ids[:limit].tolist() and row.trained.tolist() == trained[:limit].tolist()
    got, _ = examples("keep_end")
    assert (got.examples, got.too_long, got.truncated) == (2, 0, 2)
    assert [u.ids.tolist() for u in got.units] == [ids[-limit:].tolist(), question_ids[-limit:].tolist()]
    assert [u.trained.tolist() for u in got.units] == [trained[-limit:].tolist(), question_trained[-limit:].tolist()]
    bos_encoder = ChatEncoder(load_tokenizer(tok_dir)[0], ChatFormat(add_bos=True))
    got, _ = examples("keep_end", "post.add_bos=true", chat=bos_encoder)
    bos_ids, _ = bos_encoder.conversation(long_talk["messages"])
    assert got.units[0].ids.tolist() == [bos_encoder.bos] + bos_ids[-(limit - 1):].tolist()


def test_generate_chat_renders_the_recorded_format(encoder, tmp_path, capsys):
    """tools.generate --chat renders a message in the format the checkpoint records (BOS included),
    not the defaults."""
    from tools.cli import ToolError
    from tools.generate import chat_encoder

    trained = ChatFormat(user_prefix="Q: ", assistant_prefix="A: ", add_bos=True).__dict__
    chat = chat_encoder(tmp_path, {"posttrain": {"chat": trained}}, encoder.sp)
    message = [{"role": "user", "content": "red tree"}]
    prompt = chat.prompt(message)
    assert prompt == ChatEncoder(encoder.sp, ChatFormat(**trained)).prompt(message) != encoder.prompt(message)
    assert prompt[0] == encoder.sp.bos_id() and encoder.sp.decode(prompt).startswith("Q: red tree")
    with pytest.raises(ToolError, match="was not post-trained"):
        chat_encoder(tmp_path, {"step": 5}, encoder.sp)
    from tools.generate import main as generate_main

    assert generate_main(["--checkpoint", str(tmp_path), "--chat", " "]) == 2
    assert "--chat is empty" in capsys.readouterr().err


def test_an_export_s_chat_template_renders_the_trained_format(tok_dir, tmp_path):
    """The exported tokenizer's chat_template renders what ChatEncoder encodes (turn prefixes, turn
    ends, EOS after the assistant's content, BOS where the format adds it, the generation prompt),
    and tokenized at once it gives the prompt ids the model trained on for a plain conversation."""
    from transformers import AutoTokenizer

    from data_prep.tokenizer import load_tokenizer
    from tools.export import save_tokenizer

    fmt = ChatFormat(user_prefix="Q: ", assistant_prefix="A: ", turn_end="\n", add_bos=True)
    save_tokenizer(tok_dir, tmp_path, chat=dataclasses.asdict(fmt))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red tree"},
                {"role": "assistant", "content": "green"}, {"role": "user", "content": "more"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (f"{hf.bos_token}System: be brief\nQ: red tree\nA: green{hf.eos_token}Q: more\nA:")
    assert hf.apply_chat_template(messages[:2], tokenize=False) == f"{hf.bos_token}System: be brief\nQ: red tree\n"
    sp, _ = load_tokenizer(tok_dir)
    assert hf.apply_chat_template(messages[:2], add_generation_prompt=True) == \
        ChatEncoder(sp, fmt).prompt(messages[:2])
    with pytest.raises(Exception, match="roles are system, user and assistant, not tool"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_sga_generation_ends_before_eos():
    """Stage 2 returns the response up to EOS, without it; with no EOS drawn, every new token."""
    from types import SimpleNamespace

    from posttrain.inference import SGAModel
    from tests.test_attention import ScriptedLogits

    def row(best: int) -> list[float]:
        return [10.0 if i == best else 0.0 for i in range(8)]

    def sga(script):
        encoder = SimpleNamespace(eos=2, bos=None, prompt=lambda messages: [5, 6])
        return SGAModel(ScriptedLogits(script), None, encoder, ScoreFormat(), ["a"], {})

    messages = [{"role": "user", "content": "hi"}]
    assert sga([row(4), row(2), row(7)]).generate(messages, {"a": 0.5}, 5, greedy=True) == [4]
    assert sga([row(4), row(7)]).generate(messages, {"a": 0.5}, 3, greedy=True) == [4, 7, 7]


def test_packing_fills_rows_greedily_and_padding_stops_at_the_cap():
    """pack opens a new row only when the next example would overflow it (one that fits exactly
    stays); collate pads to a multiple of 8 but never past the row length it is given."""
    rng = random.Random(0)

    def row(n: int) -> Row:
        return Row(np.arange(n), np.ones(n, dtype=bool))

    assert [len(r.ids) for r in pack([row(3), row(5), row(1)], 8)] == [8, 1]
    # An example whose first token is a target (an assistant turn with no prefix, no BOS) trains
    # the targets it trains unpacked: none is predicted across the boundary from the one before.
    [joined] = pack([row(3), row(5)], 8)
    assert joined.trained.tolist() == [False, True, True, False, True, True, True, True]
    unpacked = sum(int(collate_rows([r], 0)["trained"][:, 1:].sum()) for r in (row(3), row(5)))
    assert int(collate_rows([joined], 0)["trained"][:, 1:].sum()) == unpacked
    lengths = [rng.randint(1, 8) for _ in range(40)]
    want, used = [], 0
    for n in lengths:  # the plain greedy rule
        if want and used + n > 8:
            used = 0
        if used == 0:
            want.append(0)
        want[-1] += n
        used += n
    assert [len(r.ids) for r in pack([row(n) for n in lengths], 8)] == want
    assert collate_rows([row(65)], 0)["tokens"].shape == (1, 72)
    assert collate_rows([row(65)], 0, cap=65)["tokens"].shape == (1, 65)
    assert all(b["tokens"].shape[1] <= 65 for b in chunked([row(65), row(30), row(64)], 2, 0, cap=65))


def test_converted_pairs_take_the_first_of_equal_best_and_worst_responses():
    from collections import Counter

    from posttrain.convert import pairs

    rated = [("d1", {"a": 3.0}), ("d2", {"a": 3.0}), ("d3", {"a": 1.0}), ("d4", {"a": 1.0})]
    got = pairs({json.dumps("D"): rated}, Counter())
    assert [(p["chosen"], p["rejected"]) for p in got] == [("d1", "d3")]
