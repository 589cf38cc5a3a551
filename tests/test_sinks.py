"""Attention-sink metrics on hand-built maps, the trigger task, and a hybrid training run that
logs sink metrics (TP = 2) followed by the checkpoint report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from models.sinks import head_stats, scalars, sink_stats
from tests import dist_utils
from tests.dist_utils import REPO, single_process_group, train
from tests.synthetic import tiny_overrides, write_synthetic_shards


def causal_uniform(t: int) -> torch.Tensor:
    return torch.ones(t, t).tril() / torch.arange(1, t + 1).unsqueeze(1)


def test_alpha1_within_documents_reads_each_documents_first_token():
    from models.sinks import document_starts

    assert document_starts(torch.tensor([[0, 0, 1, 1, 1, 2]])).tolist() == [[0, 0, 2, 2, 2, 5]]
    # Query 2 begins a new document and puts all its weight on itself: its document's first token.
    w = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])[None, None]  # [batch, heads, q, k]
    alpha_plain, _, _ = head_stats(w)
    alpha_docs, _, _ = head_stats(w, torch.tensor([[0, 0, 2]]))
    torch.testing.assert_close(alpha_plain, torch.tensor([0.5]))
    torch.testing.assert_close(alpha_docs, torch.tensor([2.5 / 3]))


def test_alpha1_of_known_maps():
    t = 8
    full_sink = torch.zeros(t, t)
    full_sink[:, 0] = 1.0
    uniform = causal_uniform(t)
    diagonal = torch.eye(t)
    maps = torch.stack([full_sink, uniform, diagonal])  # three heads
    alpha, total, share = head_stats(maps)
    harmonic = sum(1.0 / (i + 1) for i in range(t)) / t  # mean_t 1/t
    torch.testing.assert_close(alpha, torch.tensor([1.0, harmonic, 1.0 / t]))
    torch.testing.assert_close(total, torch.ones(3))
    stats = sink_stats({0: maps.unsqueeze(0), 1: torch.stack([uniform, uniform, full_sink]).unsqueeze(0)})
    # alpha > 0.3: layer 0 heads (1, 0.34, 0.125) -> 2 of 3; layer 1 (0.34, 0.34, 1) -> 3 of 3
    assert harmonic > 0.3
    assert stats.sink_rate(0.3) == pytest.approx(5 / 6)
    torch.testing.assert_close(stats.layer_sink_rate(0.3), torch.tensor([2 / 3, 1.0]))
    assert stats.sink_rate(0.5) == pytest.approx(2 / 6)
    flat = scalars(stats, 0.3)
    assert flat["sink_rate"] == pytest.approx(5 / 6)
    assert flat["layer00/head02/alpha1"] == pytest.approx(1 / t)


def test_sink_rate_thresholds_each_sequence_then_averages():
    """Gu et al. threshold alpha_1 per sequence: a head with 0.55 on one sequence's first token and
    0.12 on another's is a sink on half of them (its mean alpha_1, 0.345, would call it one on all);
    a sequence that is all padding counts in none."""
    t = 64

    def head(a1: float) -> torch.Tensor:
        weights = torch.zeros(t, t, dtype=torch.float64)
        weights[0, 0] = 1.0
        for i in range(1, t):
            weights[i, 0], weights[i, 1:i + 1] = a1, (1 - a1) / i
        return weights

    maps = {0: torch.stack([head(0.55), head(0.12), head(0.9)])[:, None]}  # [batch, heads, q, k]
    queries = torch.tensor([True, True, False])[:, None].expand(3, t)  # the third sequence is padding
    stats = sink_stats(maps, None, queries)
    assert float(stats.alpha1) == pytest.approx((0.55 * 63 + 1 + 0.12 * 63 + 1) / 128)
    assert stats.sink_rate(0.3) == pytest.approx(0.5) and stats.layer_sink_rate(0.3).tolist() == [0.5]
    assert stats.sink_rate(0.1) == pytest.approx(1.0) and stats.sink_rate(0.6) == pytest.approx(0.0)
    assert scalars(stats, 0.3)["sink_rate"] == pytest.approx(0.5)


def test_head_statistics_average_over_the_kept_queries_only():
    """Padding queries (queries=False) count in none of the three: here their rows sum to 5 and put
    everything on the first key, unlike the kept rows."""
    gen = torch.Generator().manual_seed(0)
    by_query = torch.rand(2, 4, 3, 4, generator=gen)  # [batch, q, heads, k]
    keep = torch.tensor([[True, True, False, False], [True, False, True, False]])
    by_query[~keep] = torch.tensor([5.0, 0.0, 0.0, 0.0])
    alpha, total, share = head_stats(by_query.transpose(1, 2), None, keep)  # weights [batch, heads, q, k]
    kept = by_query[keep].transpose(0, 1)  # [heads, kept queries, k]
    torch.testing.assert_close(alpha, kept[..., 0].mean(-1))
    torch.testing.assert_close(total, kept.sum(-1).mean(-1))
    torch.testing.assert_close(share, (kept[..., 0] / kept.sum(-1)).mean(-1))


def test_relu_absolute_weight_is_not_a_share():
    """A ReLU head that outputs ~0 everywhere with a tiny weight on the first token: the share of
    the row (Gu's proxy) says 'sink', the absolute weight does not."""
    t = 16
    quiet = torch.zeros(t, t)
    quiet[:, 0] = 0.02  # only the first token gets any weight, and very little
    busy = causal_uniform(t) * 2.0  # rows sum to 2, weight spread evenly
    alpha, total, share = head_stats(torch.stack([quiet, busy]))
    torch.testing.assert_close(alpha[0], torch.tensor(0.02))
    torch.testing.assert_close(share[0], torch.tensor(1.0))  # the proxy would report a perfect sink
    torch.testing.assert_close(total, torch.tensor([0.02, 2.0]))
    stats = sink_stats({0: torch.stack([quiet, busy]).unsqueeze(0)})
    # busy: alpha = 2 * mean 1/t = 0.68 > 0.3 is a real (absolute) concentration; quiet is not
    assert stats.alpha1[0, 1] > 0.3
    assert stats.sink_rate(0.3) == pytest.approx(0.5)


def test_a_short_probe_of_a_seqlen_relu_model_weighs_rows_as_training_did():
    """ReLU's seqlen normaliser divides every row by the sample length: the metrics' probe of the
    first 12 tokens gives the weights those rows have in the model's 24-token samples (relu, and a
    LISA layer reading relu scores)."""
    from models.sinks import capture_attention
    from tests.test_attention import build, small_cfg

    cfg = small_cfg("rrl")
    cfg.relu_attention.normalizer = "seqlen"
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    with single_process_group():
        model = build(cfg).double().eval()
        with torch.no_grad():
            trained = capture_attention(model, tokens)
            probe = capture_attention(model, tokens[:, :12], row_length=cfg.max_seq_len)
            unscaled = capture_attention(model, tokens[:, :12])
    assert sorted(probe) == [0, 1, 2]
    for layer, weights in probe.items():
        torch.testing.assert_close(weights, trained[layer][..., :12, :12], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(unscaled[0], 2 * probe[0])  # without it: divided by 12, not 24


class UniformWithinDocuments(torch.nn.Module):
    """Stands in for a model: one head that attends evenly over the keys each query sees."""

    def logits(self, tokens, ctx):
        seq = tokens.shape[1]
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril().expand(tokens.shape[0], seq, seq)
        if "document_ids" in ctx:
            documents = ctx["document_ids"]
            allowed = allowed & (documents[:, :, None] == documents[:, None, :])
        weights = allowed.float() / allowed.sum(-1, keepdim=True)
        ctx["attention_maps"] = {0: weights[:, None]}


def test_post_training_probe_attends_within_packed_examples_and_skips_padding():
    """Row 0 packs examples of 3 and 5 tokens; row 1 holds one of 6 and 2 padding tokens."""
    from types import SimpleNamespace

    from models.sinks import measure
    from posttrain.train import PostTrainer

    batch = {"tokens": torch.arange(18).reshape(2, 9),
             "documents": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]),
             "real": torch.tensor([[True] * 8, [True] * 6 + [False] * 2])}
    trainer = SimpleNamespace(val_batches=[batch], device=torch.device("cpu"))
    tokens, documents, queries = PostTrainer.probe_batch(trainer, 64)  # the probe's length: at most the inputs
    assert tokens.shape == documents.shape == queries.shape == (2, 8)
    stats = measure(UniformWithinDocuments(), tokens, documents, queries)
    # each real query weighs 1 / (its position in its example, from 1) on the example's first token
    expected = sum(1 / t for n in (3, 5, 6) for t in range(1, n + 1)) / 14
    assert float(stats.alpha1) == pytest.approx(expected)
    assert stats.uniform1 == pytest.approx(expected)  # this head is the uniform one
    assert scalars(stats)["alpha1_uniform"] == pytest.approx(expected)


def test_pretraining_probe_attends_within_documents_where_training_does():
    """With data.document_mask (document_eos set) the sink probe's rows split at EOS as training's do."""
    from types import SimpleNamespace

    from models.attention.masks import document_ids
    from models.sinks import measure
    from pretrain.trainer import Trainer

    batch = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 4, 4], [2, 5, 5, 5, 5, 2, 6, 6, 6]])  # EOS = 2
    masked = SimpleNamespace(val_batches=[batch], device=torch.device("cpu"), document_eos=2)
    tokens, documents, queries = Trainer.probe_batch(masked, 8)
    assert torch.equal(tokens, batch[:, :8]) and queries is None
    assert torch.equal(documents, document_ids(batch[:, :8], 2))
    whole = Trainer.probe_batch(SimpleNamespace(val_batches=[batch], device=torch.device("cpu"), document_eos=None), 8)
    assert whole[1] is None  # no mask: whole rows
    within, across = measure(UniformWithinDocuments(), tokens, documents), measure(UniformWithinDocuments(), tokens)
    assert float(within.alpha1) > float(across.alpha1)  # shorter documents: more weight on their first token


def test_sink_report_probes_random_tokens_as_the_run_began_its_samples(monkeypatch, tmp_path, capsys):
    """Shards that cannot be read: random ordinary tokens, after BOS where the run's samples had it."""
    from types import SimpleNamespace

    import tools.sink_report as report
    from pretrain.config import Config

    run = Config()
    run.data.shards, run.data.start_with_bos = str(tmp_path / "moved"), True
    monkeypatch.setattr(report, "run_config", lambda ckpt: run)
    meta = {"bos_id": 1, "eos_id": 2, "special_ids": {"pad": None, "unk": 0}}
    tokens, source = report.sample_tokens(tmp_path, SimpleNamespace(vocab_size=8), meta, 4, 64, None)
    warning = capsys.readouterr().err
    assert source == "random tokens after BOS" and "using random tokens" in warning
    assert f"no such directory ({tmp_path / 'moved'}" in warning and "--shards DIR" in warning
    assert tokens[:, 0].eq(1).all() and tokens.shape == (4, 64)
    assert not torch.isin(tokens[:, 1:], torch.tensor([0, 1, 2])).any()


def test_trigger_task_trains():
    from bench.sink_trigger import TaskSpec, make_batch, train_model

    spec = TaskSpec(seq=12, dim=8)
    inputs, targets, trigger = make_batch(spec, 64, torch.Generator().manual_seed(0))
    b, i = map(int, torch.nonzero(trigger)[0])
    torch.testing.assert_close(targets[b, i], inputs[b, 1:i, :8].mean(0))  # mean of non-BOS content
    assert targets[~trigger].abs().sum() == 0 and inputs[:, 0, 8].eq(1).all()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: extra threads only contend
    try:
        common = dict(steps=40, spec=spec, width=16, seed=0, batch=32, keep_maps=True)
        relu = train_model("relu", layers=1, heads=1, **common)
        soft = train_model("softmax", layers=1, heads=2, **common)
    finally:
        torch.set_num_threads(threads)
    _, _, trigger = make_batch(spec, 512, torch.Generator().manual_seed(10_000))  # evaluate's batch (seed 0)
    queries = ~trigger
    queries[:, 0] = False  # the BOS query sees only BOS
    for result in (relu, soft):
        assert result["loss_end"] < 0.8 * result["loss_start"], result
        [weights] = result["_maps"]  # [B, H, T, T], one layer
        bos = torch.stack([weights[:, h, :, 0][queries] for h in range(weights.shape[1])])
        rows = torch.stack([weights[:, h].sum(-1)[queries] for h in range(weights.shape[1])])
        assert result["bos_mass_nontrigger"] == pytest.approx(float(bos.mean(1).mean()), rel=1e-5)
        assert result["row_total_nontrigger"] == pytest.approx(float(rows.mean(1).mean()), rel=1e-5)
        assert 0 < result["bos_mass_nontrigger"] < 1
        per_sequence = (weights[..., 0].mean(-1) > 0.3).float().mean()  # Gu et al.: thresholded per sequence
        assert result["sink_rate_0.3"] == pytest.approx(float(per_sequence))
    assert soft["row_total_nontrigger"] == pytest.approx(1.0, abs=1e-5)  # softmax rows sum to one


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """A 4-step TP = 2 run of a 5-layer hybrid (softmax, softmax_sink, softmax, relu, lisa)."""
    tmp = tmp_path_factory.mktemp("hybrid")
    root = write_synthetic_shards(tmp / "data", seq_len=32)
    run = tmp / "run"
    overrides = tiny_overrides(root, run, **{"train.steps": 4, "train.eval_interval": 2, "train.save_interval": 4})
    train(2, overrides + ["model.attention=sksrl", "model.num_layers=5", "parallel.tensor=2",
                          "model.lisa.align_group=2", "model.relu_attention.block_size=8"])
    return root, run


# pretrain.train as it was before LISA's head mixing left weight decay (DECAY_GROUPS 1).
DECAYING_LISA_TRAIN = """
import sys
import pretrain.engine
pretrain.engine.DECAY_GROUPS = 1
from pretrain.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_resumes_with_the_weight_decay_groups_it_started_with(tmp_path):
    """A checkpoint saved when LISA's head mixing was decayed (its marker records no decay_groups)
    resumes with those groups: its optimizer state is laid out by them (DeepSpeed refuses others)."""
    root = write_synthetic_shards(tmp_path / "data")
    run, script = tmp_path / "run", tmp_path / "decaying_lisa_train.py"
    script.write_text(DECAYING_LISA_TRAIN)
    lisa = {"model.attention": "sl", "model.lisa.keep_full_layers": 1, "train.steps": 2,
            "train.warmup_steps": 1, "train.save_interval": 2, "train.eval_batches": 0}
    dist_utils.torchrun(1, [str(script), *tiny_overrides(root, run, **lisa)])
    marker = run / "checkpoints" / "step_00000002" / "COMPLETE"
    meta = json.loads(marker.read_text())
    assert meta.pop("decay_groups") == 1
    marker.write_text(json.dumps(meta))
    out = train(1, tiny_overrides(root, run, **{**lisa, "train.steps": 3}))
    assert "LISA's head mixing and biases decay as when the run started" in out.stdout
    assert json.loads((run / "checkpoints" / "step_00000003" / "COMPLETE").read_text())["decay_groups"] == 1


def run_module(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=dist_utils.child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_hybrid_tp2_training_logs_sink_metrics_and_report(hybrid_run, tmp_path, capsys, monkeypatch):
    import shutil

    root, run = hybrid_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sinks = [r for r in records if "sinks/sink_rate" in r]
    assert [r["step"] for r in sinks] == [2, 4]
    last = sinks[-1]
    # TP = 2 holds 2 heads per rank; the logged heads are the gathered 4
    assert {f"sinks/layer{l:02d}/head{h:02d}/alpha1" for l in range(5) for h in range(4)} <= last.keys()
    assert "sinks/layer05/head00/alpha1" not in last and "sinks/layer00/head04/alpha1" not in last
    assert 0.0 <= last["sinks/sink_rate"] <= 1.0
    assert last["sinks/layer00/row_total"] == pytest.approx(1.0, abs=1e-5)  # softmax rows sum to one
    assert last["sinks/layer01/row_total"] < 1.0  # softmax_sink: the sink logit takes a share
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    out = tmp_path / "report"
    proc = run_module("tools.sink_report", "--checkpoint", str(run / "checkpoints" / "step_00000004"),
                      "--out", str(out))
    assert "Sink_1^0.3" in proc.stdout and "lisa" in proc.stdout
    assert "note: --seq 64 is longer than the model's model.max_seq_len=32: measuring 32 tokens" in proc.stdout
    report = json.loads((out / "sink_report.json").read_text())
    assert report["kinds"] == ["softmax", "softmax_sink", "softmax", "relu", "lisa"]
    assert torch.tensor(report["alpha1"]).shape == (5, 4)
    # the report merges the two tensor-parallel shards and measures the same batch: same numbers
    for l in range(5):
        for h in range(4):
            assert report["alpha1"][l][h] == pytest.approx(last[f"sinks/layer{l:02d}/head{h:02d}/alpha1"], abs=1e-4)
    assert (out / "sink_heatmap.png").stat().st_size > 1000
    # Shards asked for that hold no validation split: an error, not a report over random tokens.
    from tools.sink_report import main as sink_report

    none = tmp_path / "none"
    assert sink_report(["--checkpoint", str(run), "--out", str(none), "--shards", str(tmp_path)]) == 2
    assert f"--shards {tmp_path}: no val/index.json there" in capsys.readouterr().err
    empty = tmp_path / "empty_val"  # an older build's val split with no shards listed
    (empty / "val").mkdir(parents=True)
    (empty / "val" / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    with single_process_group():  # the model is read in this process
        assert sink_report(["--checkpoint", str(run), "--out", str(none), "--shards", str(empty)]) == 2
    assert f"--shards {empty}: no samples in their val/ split" in capsys.readouterr().err
    assert not none.exists()
    # A report there already is not replaced unasked, before the model is read.
    before = (out / "sink_report.json").read_bytes()
    assert sink_report(["--checkpoint", str(run), "--out", str(out)]) == 2
    assert "holds a report already (sink_report.json, sink_heatmap.png)" in capsys.readouterr().err
    assert (out / "sink_report.json").read_bytes() == before
    # Shards of another tokenizer: refused, not measured.
    other = tmp_path / "other_shards"
    shutil.copytree(root / "shards" / "val", other / "val")
    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "f" * 64}))
    with single_process_group():
        assert sink_report(["--checkpoint", str(run), "--out", str(none), "--shards", str(other)]) == 2
    assert f"--shards {other}: tokenized with another tokenizer (sha256 ffffffffffff)" in capsys.readouterr().err
    # The run's own relative data.shards, read from above the run directory (where it was launched),
    # not replaced by random tokens when the report runs elsewhere.
    project = tmp_path / "project"
    shutil.copytree(run, project / "runs" / "hybrid", ignore=shutil.ignore_patterns("tensorboard", "universal"))
    (project / "data").mkdir()
    (project / "data" / "shards").symlink_to(root / "shards")
    config = project / "runs" / "hybrid" / "config.yaml"
    config.write_text(config.read_text().replace(str(root / "shards"), "data/shards"))
    (tmp_path / "here" / "data").mkdir(parents=True)  # the current directory's data/shards: another tokenizer's
    (tmp_path / "here" / "data" / "shards").symlink_to(other)
    monkeypatch.chdir(tmp_path / "here")
    with single_process_group():
        assert sink_report(["--checkpoint", str(project / "runs" / "hybrid"), "--out", str(tmp_path / "moved")]) == 0
    assert json.loads((tmp_path / "moved" / "sink_report.json").read_text())["tokens"] == \
        f"validation shards {project / 'data' / 'shards'}"


@pytest.mark.slow
def test_convert_lisa_on_trained_checkpoint(hybrid_run, tmp_path, capsys):
    root, run = hybrid_run
    out = tmp_path / "lisa"
    proc = run_module("tools.convert_lisa", "--checkpoint", str(run / "checkpoints" / "step_00000004"),
                      "--layers", "auto", "--calib-shards", str(root / "shards"), "--out", str(out),
                      "--steps", "6", "--calib-batches", "2")
    report = json.loads((out / "conversion.json").read_text())
    # layers 0-1 are kept full; layer 3 (relu) cannot share a softmax layer's scores; so layer 2
    assert report["layers"] == [2]
    assert report["attention"] == "softmax,softmax_sink,lisa,relu,lisa"
    assert report["qk_params"]["compression"] >= 6
    p = report["params"]
    assert p["converted"] < p["source"] and 0 < p["trained"] < 0.1 * p["converted"]
    assert all(v == v and v < 10 for v in report["val_loss"].values())
    # Refused before the model is read: an --out that holds a run, layer indices that are not numbers,
    # shards that are not there.
    from tools.convert_lisa import main as convert_main

    common = ["--checkpoint", str(tmp_path / "no_such_run"), "--calib-shards", str(root / "shards")]
    assert convert_main(common + ["--out", str(out)]) == 2
    assert f"--out {out} exists and is not empty" in capsys.readouterr().err
    assert convert_main(common + ["--out", str(tmp_path / "new"), "--layers", "3,x"]) == 2
    assert "--layers '3,x': give auto, sensitivity or layer indices" in capsys.readouterr().err
    assert convert_main(common + ["--out", str(tmp_path / "new"), "--max-chain", "-1"]) == 2
    assert "--max-chain -1: give a number of LISA layers in a row" in capsys.readouterr().err
    for option, value, said in (("--max-fraction", "0.0", "give the largest share of layers to convert, in (0, 1]"),
                                ("--max-fraction", "2.0", "give the largest share"), ("--val-samples", "0", "give at least 1"),
                                ("--loss-budget", "-1.0", "give the largest relative loss increase, >= 0")):
        assert convert_main(common + ["--out", str(tmp_path / "new"), option, value]) == 2
        assert f"{option} {value}: {said}" in capsys.readouterr().err
    assert convert_main(common + ["--out", str(run), "--overwrite"]) == 2  # a run: never, even with --overwrite
    assert "holds checkpoints of a run" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert convert_main(common + ["--out", str(tmp_path / "new"), "--calib-shards", str(tmp_path)]) == 2
    assert f"--calib-shards {tmp_path}: no train/index.json there" in capsys.readouterr().err
    # Layers that cannot be converted: refused before the calibration passes.
    ckpt = str(run / "checkpoints" / "step_00000004")
    with single_process_group():  # the model is read in this process
        assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(root / "shards"), "--layers", "1",
                             "--out", str(tmp_path / "new")]) == 2
    said = capsys.readouterr()
    assert "--layers 1: layer 1 is within model.lisa.keep_full_layers=2" in said.err
    assert "sim to l-1" not in said.out
    with single_process_group():
        assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(root / "shards"), "--layers", "0",
                             "--keep-full-layers", "0", "--out", str(tmp_path / "new")]) == 2
    assert ("--layers 0: layer 0 has no earlier layer whose attention scores a LISA layer could reuse"
            in capsys.readouterr().err)
    with single_process_group():  # no layer left to choose from: keep_full_layers covers all but the LISA one
        assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(root / "shards"),
                             "--keep-full-layers", "4", "--out", str(tmp_path / "new")]) == 2
        said = capsys.readouterr()
        assert "no layer of this 5-layer model can become a LISA layer: layer 0 has no earlier layer" in said.err
        assert "(--keep-full-layers sets how many stay, 4 now)" in said.err and "sim to l-1" not in said.out
        # covering the model's own LISA layer (4) would make it invalid: refused before calibration
        assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(root / "shards"),
                             "--keep-full-layers", "5", "--out", str(tmp_path / "new")]) == 2
    said = capsys.readouterr()
    assert "puts lisa at layers [4], but model.lisa.keep_full_layers=5" in said.err and "sim to l-1" not in said.out
    # Calibration shards the model cannot read as it was trained: refused before the passes.
    import shutil

    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    for name, change, error in (("other_tok", {"tokenizer_sha256": "f" * 64}, "tokenized with another tokenizer "
                                 "(sha256 ffffffffffff)"),
                                ("longer", {"seq_len": 4096}, "sequences of 4096 tokens, longer than the model's")):
        shutil.copytree(root / "shards", tmp_path / name)
        (tmp_path / name / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with single_process_group():
            assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(tmp_path / name), "--layers", "2",
                                 "--out", str(tmp_path / "new")]) == 2
        said = capsys.readouterr()
        assert error in said.err and "sim to l-1" not in said.out, said.err
    with single_process_group():  # a fraction that allows no layer of five
        assert convert_main(["--checkpoint", ckpt, "--calib-shards", str(root / "shards"), "--max-fraction", "0.1",
                             "--out", str(tmp_path / "new")]) == 2
    said = capsys.readouterr()
    assert "--max-fraction 0.1 allows no layer of this 5-layer model; give at least 0.2" in said.err
    assert "sim to l-1" not in said.out  # before the calibration passes
    assert "val loss: source" in proc.stdout
    from pretrain.checkpoint_format import read_meta, resolve_checkpoint

    marker = read_meta(resolve_checkpoint(out / "converted"))  # what tools.evaluate / export / generate read
    assert marker["model"]["attention"] == report["attention"] and marker["lisa_layers"] == [2]

    # The written config continues training the converted model (train.init_from=its checkpoint),
    # here at TP=2; with lr = 0 the run's checkpoint holds exactly the converted weights.
    train(2, ["--config", str(out / "config.yaml"), f"data.shards={root / 'shards'}", "train.steps=1",
              "train.lr=0", "train.warmup_steps=0", "train.save_interval=1", "train.eval_interval=1",
              "parallel.tensor=2"])
    compare = ("import sys, torch; from pretrain.consolidate import load_model; "
               "m, _, _ = load_model(sys.argv[1]); want = load_model(sys.argv[2])[0].state_dict(); "
               "print(max(float((v - want[k]).abs().max()) for k, v in m.state_dict().items() if torch.is_tensor(v)))")
    proc = subprocess.run([sys.executable, "-c", compare, str(out), str(out / "converted")], cwd=REPO,
                          env=dist_utils.child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == 0.0
    # A checkpoint copied without its run's config.yaml: the config written holds the defaults and the new model
    import shutil

    import yaml

    from tools.convert_lisa import main as convert_main

    lone = tmp_path / "copied" / "step_00000004"
    shutil.copytree(run / "checkpoints" / "step_00000004", lone)
    with single_process_group():
        assert convert_main(["--checkpoint", str(lone), "--calib-shards", str(root / "shards"), "--layers", "2",
                             "--steps", "0", "--calib-batches", "1", "--val-samples", "4",
                             "--out", str(tmp_path / "from_copy")]) == 0
    assert "the source run's config.yaml was not found" in capsys.readouterr().out
    written = yaml.safe_load((tmp_path / "from_copy" / "config.yaml").read_text())
    assert written["model"]["attention"] == report["attention"]
    assert written["train"]["init_from"] == str(tmp_path / "from_copy" / "converted" / "checkpoints" / "step_00000000")


def test_paper_trigger_task_data_follows_the_paper():
    from bench.sink_paper import trigger_batch

    x, y, j = trigger_batch(4000, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4000, 16, 16)
    bos = torch.zeros(16)
    bos[0] = 1.0
    assert torch.equal(x[:, 0], bos.expand(4000, 16))  # BOS = e_0, no noise
    rows = torch.arange(4000)
    assert j.min() == 2 and j.max() == 15  # 0-indexed 2..L-1 = 1-indexed 3..L
    counts = torch.bincount(j, minlength=16)[2:].float()
    assert (counts - counts.mean()).abs().max() < 0.2 * counts.mean()  # uniform
    noise = x[:, 1:, 2:15]
    assert noise.abs().max() <= 1 and abs(float(noise.mean())) < 0.01 and abs(float(noise.var()) - 1 / 3) < 0.01
    trigger = torch.zeros(4000, 16, dtype=torch.bool)
    trigger[rows, j] = True
    assert torch.equal(x[:, :, 1] == 1, trigger)  # the trigger flag marks exactly the trigger
    assert torch.equal(x[:, 1:, 15], (~trigger[:, 1:]).float())  # content flag: every non-BOS token but it
    assert x[rows, j, 2:15].abs().sum() > 0  # the trigger keeps its noise
    expected = torch.zeros_like(y)
    for b in range(0, 4000, 397):
        expected_b = x[b, 1:j[b] + 1].mean(0)  # tokens 1..j: BOS out, the trigger in
        torch.testing.assert_close(y[b, j[b]], expected_b)
    assert torch.equal(y[~trigger], expected[~trigger])  # zero elsewhere
    xr, yr, jr = trigger_batch(8, generator=torch.Generator().manual_seed(1), trigger=8, residual=True)
    assert (jr == 7).all()
    diff = yr - xr
    assert torch.equal(diff[:, [p for p in range(16) if p != 7]], torch.zeros(8, 15, 16))
    torch.testing.assert_close(diff[:, 7], xr[:, 1:8].mean(1))


def test_paper_attention_normalisers_and_heatmaps(tmp_path):
    from bench.sink_paper import PaperAttention, draw, train_one

    torch.manual_seed(0)
    layer = PaperAttention(16, 2, "relu")
    x = torch.randn(3, 16, 16)
    with torch.no_grad():  # scores q.k = 1 for every pair: ReLU row i is 1 / max(i, 1) on its keys
        layer.q.weight.zero_()
        layer.k.weight.zero_()
        layer.q.weight[:, 0] = 0.25  # 16 dims of 0.25 x 0.25 per head
        layer.k.weight[:, 0] = 0.25
        x[:, :, 0] = 1.0
        relu = layer.weights(x)
    expected = torch.tril(torch.ones(16, 16)) / torch.arange(16).clamp(min=1)[:, None].float()
    torch.testing.assert_close(relu, expected.expand(3, 2, 16, 16))
    soft = PaperAttention(16, 1, "softmax").weights(torch.randn(2, 16, 16))
    torch.testing.assert_close(soft.sum(-1), torch.ones(2, 1, 16))
    assert soft.triu(1).abs().max() == 0
    result = train_one(("softmax", 2, 2, 0, 2))
    assert result["steps"] == 2 and not result["converged"] and len(result["bos_attention"]) == 2
    path = draw(result, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_layers_take_this_projects_attention_kinds():
    from bench.sink_paper import PROJECT_KINDS, PaperAttention
    from models.attention.base import scaled_scores
    from models.attention.relu import relu_weights

    x = torch.randn(2, 16, 16)
    for kind in PROJECT_KINDS:
        torch.manual_seed(0)
        w = PaperAttention(16, 2, kind).weights(x)
        assert w.shape == (2, 2, 16, 16) and w.triu(1).abs().max() == 0, kind
    torch.manual_seed(0)
    layer = PaperAttention(16, 2, "ours-relu-prefix")
    q = layer.q(x).view(2, 16, 2, 16).transpose(1, 2)
    k = layer.k(x).view(2, 16, 2, 16).transpose(1, 2)
    torch.testing.assert_close(layer.weights(x), relu_weights(scaled_scores(q, k), "prefix"))
    # content divides row i by max(i, 1) as the paper's ReLU does; only the 1/sqrt(d) = 1/4 differs.
    torch.manual_seed(0)
    content = PaperAttention(16, 2, "ours-relu-content").weights(x)
    torch.manual_seed(0)
    torch.testing.assert_close(4 * content, PaperAttention(16, 2, "relu").weights(x))
    sink = PaperAttention(16, 1, "ours-softmax_sink")
    with torch.no_grad():
        sink.sink.fill_(5.0)  # a large sink logit takes most of every row
    assert float(sink.weights(x).sum(-1).max().detach()) < 0.5


def test_sink_benchmarks_refuse_flags_they_cannot_run(capsys):
    """Before any model trains: a kind name that is not a kind (it ran the paper's ReLU under that
    name), a model size that is not LAYERSxHEADS, a task too short for its trigger."""
    from bench import sink_paper, sink_trigger

    for argv in (["--kinds", "softmax_sink"], ["--models", "2"], ["--models", "2x0"]):
        with pytest.raises(SystemExit):
            sink_paper.main(argv)
    for argv in (["--seq", "2"], ["--width", "30"]):
        with pytest.raises(SystemExit):
            sink_trigger.main(argv)
    err = capsys.readouterr().err
    assert "invalid choice: 'softmax_sink'" in err and "--models 2: give LAYERSxHEADS" in err
    assert "--seq 3 or more" in err and "--width 30: the models with [4] heads" in err
