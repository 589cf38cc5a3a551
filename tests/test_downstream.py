"""Downstream multiple-choice evaluation: the task shapes, the scores against a plain reference
scorer, and the in-loop accuracy at TP=2 and DP=2 equal to one process and to tools.evaluate."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from pretrain.downstream import Example, accuracy, choice_logprobs, load_task, parse_example, requests
from tests.dist_utils import REPO, child_env, single_process_group, train
from tests.synthetic import make_text, tiny_overrides, write_synthetic_shards


def test_task_shapes_and_bad_records():
    assert parse_example({"ctx": "a", "endings": ["b", "c"], "label": "1"}) == Example("a", ("b", "c"), 1)
    assert parse_example({"question": "q", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]},
                          "answerKey": "C"}) == Example("q", ("x", "y", "z"), 2)
    assert parse_example({"goal": "g", "sol1": "s", "sol2": "t", "label": 0}) == Example("g", ("s", "t"), 0)
    assert parse_example({"context": "c", "choices": ["1", "2"], "gold": 1}).gold == 1
    for bad, why in (({"choices": ["a", "b"], "gold": 0}, "no context"),
                     ({"context": "c", "choices": ["a", "b"], "label": True}, "not an index"),
                     (["c", ["a", "b"], 0], "not a JSON object"),
                     ({"context": "c", "choices": ["a"], "gold": 0}, "at least two"),
                     ({"context": "c", "choices": ["a", "b"], "gold": 2}, "not an index")):
        with pytest.raises(ValueError, match=why):
            parse_example(bad)
    # acc_norm divides by characters, as lm-eval's acc_norm (per UTF-8 byte "é" would win here).
    scores = accuracy([Example("c", ("é", "ab"), 1)], torch.tensor([-1.5, -2.5], dtype=torch.float64))
    assert scores["acc"] == 0.0 and scores["acc_norm"] == 1.0


def write_task(path, n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    # contexts ending in whitespace too ("Answer: ", a newline), which lm-eval moves into the choice
    examples = [Example(make_text(rng, 2).rstrip() + ("", " ", "\n")[i % 3],
                        tuple(make_text(rng, 1).strip() for _ in range(3)), rng.randrange(3)) for i in range(n)]
    lines = [json.dumps({"context": e.context, "choices": list(e.choices), "gold": e.gold}) for e in examples]
    path.write_text("\n".join(lines[:2] + ["{broken"] + lines[2:]) + "\n")
    return examples


def test_scores_equal_a_plain_reference_scorer(tmp_path, tok_dir):
    from data_prep.sources import BadInputReport
    from data_prep.tokenizer import load_tokenizer
    from models.config import ModelConfig
    from models.gpt import GPT

    sp, meta = load_tokenizer(tok_dir)
    examples = write_task(tmp_path / "task.jsonl", 5)
    report = BadInputReport()
    assert load_task(tmp_path / "task.jsonl", report=report) == examples and report.count == 1
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=meta["vocab_size"], hidden_size=32, num_heads=2, num_layers=2,
                                ffn_hidden_size=64, max_seq_len=64)).eval()
        reqs = requests(examples, sp, model.cfg.max_seq_len)
        got = choice_logprobs(model, reqs, batch_size=4, device=torch.device("cpu"))
        want = []
        with torch.no_grad():
            for ex in examples:
                for choice in ex.choices:  # lm-eval's _encode_pair, with its target delimiter " "
                    kept = ex.context.rstrip()
                    ctx = sp.encode(kept)
                    cont = sp.encode(kept + ex.context[len(kept):] + " " + choice)[len(ctx):]
                    tokens = torch.tensor(ctx + cont)
                    # over the real vocabulary: the padding columns are not tokens a model can emit
                    logp = model.logits(tokens[None, :-1])[0, :, :sp.vocab_size()].float().log_softmax(-1)
                    want.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    acc = accuracy(examples, got)
    plain = [max(range(3), key=lambda c: want[3 * i + c]) == ex.gold for i, ex in enumerate(examples)]
    assert acc["acc"] == sum(plain) / len(examples) and acc["examples"] == 5
    # data.start_with_bos: BOS, then the same context and choice tokens; BOS stays first when cut.
    longer = [Example(ex.context, tuple(f"{c} and then some more words" for c in ex.choices), ex.gold)
              for ex in examples]
    plain_reqs = requests(longer, sp, model.cfg.max_seq_len)
    with_bos = requests(longer, sp, model.cfg.max_seq_len, bos=1)
    assert [([1] + tokens, n) for tokens, n in plain_reqs] == with_bos
    assert min(n for _, n in plain_reqs) > 2
    for (tokens, n), (cut, n_cut) in zip(requests(longer, sp, 12), requests(longer, sp, 12, bos=1)):
        assert cut[0] == 1 and len(cut) == len(tokens) == 13 and cut[1:] == tokens[1:] and n_cut == n


@pytest.mark.slow
def test_in_loop_accuracy_at_tp2_and_dp2_equals_one_process_and_the_command(tmp_path, tok_dir):
    from data_prep.tokenizer import load_tokenizer

    _, meta = load_tokenizer(tok_dir)
    data = write_synthetic_shards(tmp_path / "data", vocab_size=meta["vocab_size"])
    manifest = json.loads((data / "shards" / "manifest.json").read_text())
    (data / "shards" / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": meta["sha256"]}))
    write_task(tmp_path / "mc.jsonl", 12, seed=1)
    common = {"data.tokenizer": tok_dir, "model.vocab_size": meta["vocab_size"], "train.steps": 6,
              "eval.downstream_tasks": str(tmp_path / "mc.jsonl"), "eval.downstream_interval": 3}
    layouts = {"one": (1, {"train.micro_batch": 8}), "dp2": (2, {}),
               "tp2": (2, {"train.micro_batch": 8, "parallel.tensor": 2})}
    acc = {}
    for name, (nproc, extra) in layouts.items():
        run = tmp_path / name
        out = train(nproc, tiny_overrides(data, run, **common, **extra))
        assert "downstream tasks: mc 12 examples" in out.stdout and "step 6 | downstream mc acc" in out.stdout
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        acc[name] = {r["step"]: (r["downstream/mc/acc"], r["downstream/mc/acc_norm"])
                     for r in records if "downstream/mc/acc" in r}
    assert sorted(acc["one"]) == [3, 6] and acc["dp2"] == acc["one"] and acc["tp2"] == acc["one"]

    res = subprocess.run([sys.executable, "-m", "tools.evaluate", "--checkpoint", str(tmp_path / "one"),
                          "--tasks", str(tmp_path / "mc.jsonl"), "--json"], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])["downstream"]["mc"]
    assert (got["acc"], got["acc_norm"]) == acc["one"][6] and got["examples"] == 12


def test_task_files_must_exist_and_have_distinct_names(tmp_path):
    from pretrain.config import ConfigError, load_config, validate

    for d in ("arc", "hellaswag"):
        (tmp_path / d).mkdir()
        write_task(tmp_path / d / "test.jsonl", 2)
    same = f"[{tmp_path / 'arc' / 'test.jsonl'}, {tmp_path / 'hellaswag' / 'test.jsonl'}]"
    with pytest.raises(ConfigError, match="two share one"):
        validate(load_config(None, [f"eval.downstream_tasks={same}", "eval.downstream_interval=10"]), 1)
    with pytest.raises(ConfigError, match="no such file"):
        validate(load_config(None, [f"eval.downstream_tasks=[{tmp_path / 'none.jsonl'}]",
                                    "eval.downstream_interval=10"]), 1)
    # Winogrande's shape is none of the accepted ones: every record is skipped, so the task would
    # log accuracy 0 at every interval. It is refused before training, and by tools.evaluate.
    wino = tmp_path / "winogrande.jsonl"
    wino.write_text(json.dumps({"sentence": "The _ fell.", "option1": "cup", "option2": "plate", "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"winogrande.jsonl holds no usable example \(bad inputs: 1 skipped"):
        validate(load_config(None, [f"eval.downstream_tasks=[{wino}]", "eval.downstream_interval=10"]), 1)


def test_a_stop_signal_skips_the_downstream_scoring_of_its_step(monkeypatch):
    """The save a signal asks for comes first: scoring every task could run past the grace time."""
    import types
    from functools import partial

    from pretrain.trainer import Trainer

    from pretrain import downstream_metrics, signals

    def scored(*args, **kwargs):
        raise AssertionError("scored despite the signal")

    monkeypatch.setattr(downstream_metrics, "evaluate_tasks", scored)
    monkeypatch.setattr(signals, "any_rank_received", lambda device: 10)  # SIGUSR1 on some rank
    printed = []
    callback = object.__new__(downstream_metrics.DownstreamEval)
    callback.interval, callback.tasks = 5, {}
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(train=types.SimpleNamespace(steps=100)),
                                    device="cpu", logger=types.SimpleNamespace(print=printed.append))
    trainer.periodic_due = partial(Trainer.periodic_due, trainer)
    callback.on_step_end(trainer, types.SimpleNamespace(step=10))
    assert printed == ["step 10 | downstream scoring skipped: stopping on a signal"]


def test_downstream_scoring_runs_every_interval_and_at_the_last_step(monkeypatch):
    """Steps 3 and 6 of 7 at interval 3, and step 7 (the last) though no multiple of it."""
    import types
    from functools import partial

    from pretrain.trainer import Trainer

    from pretrain import downstream_metrics, signals

    scored_at = []
    monkeypatch.setattr(downstream_metrics, "evaluate_tasks", lambda *args: scored_at.append(step) or {})
    monkeypatch.setattr(downstream_metrics, "run_bos", lambda *args: None)
    monkeypatch.setattr(downstream_metrics.ps, "get_data_parallel_group", lambda: None)
    monkeypatch.setattr(signals, "any_rank_received", lambda device: 0)
    callback = object.__new__(downstream_metrics.DownstreamEval)
    callback.interval, callback.tasks, callback.sp = 3, {}, None
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(train=types.SimpleNamespace(steps=7, micro_batch=2)),
                                    device="cpu", meta={}, model=None,
                                    logger=types.SimpleNamespace(print=lambda *a: None, scalars=lambda *a, **k: None))
    trainer.periodic_due = partial(Trainer.periodic_due, trainer)
    for step in range(1, 8):
        callback.on_step_end(trainer, types.SimpleNamespace(step=step))
    assert scored_at == [3, 6, 7]


def test_a_model_that_reads_the_row_length_scores_each_request_alone(tmp_path, tok_dir):
    """ReLU attention with the seqlen normaliser divides by the row's length, so a request padded to
    a longer one in its task scored differently than alone: such a model scores requests unpadded."""
    from data_prep.tokenizer import load_tokenizer
    from models.config import ModelConfig
    from models.attention.relu import ReLUAttentionConfig
    from models.gpt import GPT

    sp, meta = load_tokenizer(tok_dir)
    short = requests([Example("a b", ("c", "d"), 0)], sp, 64)
    longer = requests([Example(" ".join(["word"] * 30), ("end", "stop"), 1)], sp, 64)
    assert max(len(t) for t, _ in longer) > max(len(t) for t, _ in short) + 10
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=meta["vocab_size"], hidden_size=32, num_heads=2, num_layers=2,
                                ffn_hidden_size=64, max_seq_len=64, attention="rr",
                                relu_attention=ReLUAttentionConfig(normalizer="seqlen"))).eval()
        alone = choice_logprobs(model, short, batch_size=4, device=torch.device("cpu"))
        beside = choice_logprobs(model, short + longer, batch_size=4, device=torch.device("cpu"))
    torch.testing.assert_close(beside[:len(short)], alone, rtol=0, atol=1e-9)
