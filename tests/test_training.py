"""Whole training runs under torchrun on gloo: data/ZeRO/tensor layouts give the single-process
losses, a resumed run continues the uninterrupted loss curve, bad resumes fail clearly."""

import gzip
import json
import shutil

import pytest

from tests.dist_utils import saved_run_copy, torchrun, train
from tests.synthetic import tiny_overrides, write_synthetic_shards

STEPS = 6


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory):
    """Single process, micro-batch 8 (the global batch of the DP=2 runs below): the run directory,
    with checkpoints of steps 4 and 6."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(1, tiny_overrides(data, run, **{"train.steps": STEPS, "train.micro_batch": 8,
                                          "run.callbacks": "[tests.user_callbacks:HookRecorder]"}))
    return run


@pytest.fixture(scope="module")
def reference(reference_run):
    return losses(reference_run)


@pytest.fixture(scope="module")
def data_parallel_run(data, tmp_path_factory):
    """data_parallel_run(stage): the run directory of a DP = 2 run of STEPS steps at that ZeRO stage,
    trained once for the tests that read it."""
    runs = {}

    def run(stage: int):
        if stage not in runs:
            runs[stage] = tmp_path_factory.mktemp(f"zero{stage}") / "run"
            overrides = {"train.steps": STEPS, "parallel.zero_stage": stage}
            train(2, tiny_overrides(data, runs[stage], **overrides))
        return runs[stage]

    return run


def records_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grad_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/grad_norm"] for r in records_of(run_dir) if "train/grad_norm" in r}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_data_parallel_zero_matches_single_process(data_parallel_run, reference_run, reference, stage):
    got = losses(data_parallel_run(stage))
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (stage, step)
    assert got[STEPS] < got[1]  # it learns
    # The gradients too (AdamW would hide a uniform scale of them, such as a sum over ranks for a mean).
    want = grad_norms(reference_run)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert grad_norms(data_parallel_run(stage)) == pytest.approx(want, rel=1e-4), stage
    # Each log step names the rank with the most memory and the one waiting longest for data.
    logged = [r for r in records_of(data_parallel_run(stage)) if "train/loss" in r]
    assert logged and all(r["train/peak_memory_gb_max"] >= r["train/peak_memory_gb"] and
                          r["train/peak_memory_gb_max_rank"] in (0, 1) and r["train/data_wait_frac_max_rank"] in (0, 1)
                          for r in logged)
    assert not any("train/peak_memory_gb_max" in r for r in records_of(reference_run))  # one rank: nothing to compare


def test_fused_optimizer_matches_the_default(data, reference, tmp_path):
    run = tmp_path / "run"
    out = train(1, tiny_overrides(data, run, **{"train.steps": STEPS, "train.micro_batch": 8,
                                                "train.fused_optimizer": "true"}))
    assert "ZeRO-1, AdamW (fused)" in out.stdout
    got = losses(run)
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_tensor_parallel_training_matches_single_process(data, tmp_path):
    ref_run, tp_run = tmp_path / "tp1", tmp_path / "tp2"
    # Clipping active: the TP grad norm must be global; z-loss on: its logsumexp spans both vocab halves;
    # two micro-batches a step: the logged parts of the loss are their means, as the loss is.
    overrides = {"train.steps": STEPS, "train.grad_clip": 0.05, "train.z_loss": 1e-3, "train.log_interval": 1,
                 "train.micro_batch": 2, "train.grad_accum": 2}
    train(1, tiny_overrides(data, ref_run, **overrides))
    train(2, tiny_overrides(data, tp_run, **overrides, **{"parallel.tensor": 2}))
    ref, got = losses(ref_run), losses(tp_run)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step
    z = [{r["step"]: r["train/z_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
          if "train/z_loss" in r} for run in (ref_run, tp_run)]
    assert sorted(z[0]) == list(range(1, STEPS + 1)) and all(v > 0 for v in z[0].values())
    assert z[1] == pytest.approx(z[0], rel=1e-5)
    for r in map(json.loads, (ref_run / "metrics.jsonl").read_text().splitlines()):  # the loss's parts
        if "train/loss" in r:
            assert r["train/ce_loss"] + r["train/z_loss"] == pytest.approx(r["train/loss"], rel=1e-6)
    # Saved at TP=2 and resumed at TP=1: the slices merge back, replicated ones (norms) taken once.
    run = tmp_path / "tp2_to_tp1"
    tag = saved_run_copy(tp_run, run, 4)
    out = train(1, tiny_overrides(data, run, **overrides))
    assert f"resumed from {tag} at step 4 on another layout" in out.stdout, out.stdout[-2000:]
    got = losses(run)
    assert sorted(got) == list(range(5, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """An 8-step DP = 2 ZeRO-2 run straight through, and the same run stopped after step 4 and
    resumed, profiling steps 3-5 on both ranks: (straight, resumed, first output, second output).
    40 train samples, 8 a step: the resumed run goes on into the second epoch after step 5."""
    tmp = tmp_path_factory.mktemp("resume")
    data = write_synthetic_shards(tmp / "data", train=40)
    straight, resumed = tmp / "straight", tmp / "resumed"
    common = {"train.steps": 8, "train.save_interval": 100, "parallel.zero_stage": 2}
    profile = {"profile.start_step": 3, "profile.steps": 3, "profile.ranks": "all"}
    train(2, tiny_overrides(data, straight, **common))
    first = train(2, tiny_overrides(data, resumed, **common, **profile, **{"train.stop_at_step": 4}))
    second = train(2, tiny_overrides(data, resumed, **common, **profile))
    return straight, resumed, first, second


def test_a_callback_of_the_user_s_own_sees_every_step_and_validation(reference_run, reference):
    """run.callbacks: a Callback named by package.module:name, built with the run's config (the
    reference run trains with tests.user_callbacks:HookRecorder)."""
    seen = [json.loads(line) for line in (reference_run / "user_callback.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in seen if "loss" in r}
    assert steps == reference and all("grad_norm" in r["logged"] for r in seen if "loss" in r)
    metrics = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    want = {m["step"]: m["val/loss"] for m in metrics if "val/loss" in m}
    assert {r["step"]: r["val"]["loss"] for r in seen if "val" in r} == want and len(want) >= 2


def test_resume_reproduces_uninterrupted_losses(resumed_run):
    straight, resumed, first, second = resumed_run
    assert "stopping at train.stop_at_step=4" in first.stdout
    assert "resumed from" in second.stdout and "step_00000004" in second.stdout
    want, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # bitwise on CPU, profiled or not
    assert len(set(want.values())) == 8  # every step a batch of its own, the second epoch's too
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == list(range(1, 9))  # log_interval 1
    assert all(0 <= r["train/data_wait_frac"] < 1 for r in records if "train/loss" in r)
    saves = {r["step"]: r for r in records if "checkpoint/save_s" in r}
    assert sorted(saves) == [4, 8] and all(r["checkpoint/size_gb"] > 0 for r in saves.values())


# pretrain.train with a callback that sends SIGUSR1 to rank 1 after the optimizer update of step
# SIGNAL_AT_STEP (before that step's validation), or as training begins with SIGNAL_AT_BEGIN.
SIGNALLING_TRAIN = """
import os, signal, sys
from pretrain.train import Task, main
from pretrain.trainer import Callback

class SignalRankOne(Callback):
    def fire(self):
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_train_begin(self, trainer, step):
        if os.environ.get("SIGNAL_AT_BEGIN"):
            self.fire()

    def on_optimizer_step(self, trainer, step):
        if str(step) == os.environ.get("SIGNAL_AT_STEP"):
            self.fire()

class Signalled(Task):
    def trainer(self, cfg, engine, batches, val_sets, logger, meta, callbacks):
        return super().trainer(cfg, engine, batches, val_sets, logger, meta, [*callbacks, SignalRankOne()])

sys.exit(main(sys.argv[1:], Signalled()))
"""


def val_losses(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["val/loss"] for r in records if "val/loss" in r}


def test_a_validation_interrupted_by_a_signal_runs_after_the_resume(data, data_parallel_run, tmp_path):
    straight, run = data_parallel_run(1), tmp_path / "run"  # ZeRO-1, the default
    script = tmp_path / "signalling_train.py"
    script.write_text(SIGNALLING_TRAIN)
    common = {"train.steps": STEPS, "train.log_interval": 100}  # validations at 4 and 6
    # The signal reaches rank 1 just before step 4's validation: every rank leaves it at its first
    # batch, and the run saves step 4 and stops.
    first = torchrun(2, [str(script), *tiny_overrides(data, run, **common)], check=False, SIGNAL_AT_STEP="4")
    assert "stopping at step 4 on SIGUSR1" in first.stdout, first.stdout + first.stderr[-3000:]
    assert val_losses(run) == {}
    # The requeue validates step 4's weights first; a signal then interrupts it again: it stops
    # without saving anything new, and the next requeue validates.
    again = torchrun(2, [str(script), *tiny_overrides(data, run, **common)], check=False, SIGNAL_AT_BEGIN="1")
    assert "running the validation the stop interrupted" in again.stdout, again.stdout + again.stderr[-3000:]
    assert "stopping at step 4 on SIGUSR1" in again.stdout and "saved checkpoint" not in again.stdout
    assert val_losses(run) == {}
    # Resumed without validation (train.eval_batches=0) the interrupted one is no longer due: it trains on.
    no_val = tmp_path / "no_val"
    shutil.copytree(run, no_val)
    no_validation = {"train.eval_batches": 0, "train.stop_at_step": 5}
    on = train(2, tiny_overrides(data, no_val, **common, **no_validation))
    assert "stopping at step" not in on.stdout and sorted(losses(no_val))[-1] == 5, on.stdout
    last = train(2, tiny_overrides(data, run, **common))
    assert "step 4: running the validation the stop interrupted" in last.stdout
    want, got = val_losses(straight), val_losses(run)
    assert sorted(got) == sorted(want) == [4, 6]
    assert got == pytest.approx(want, rel=1e-6)
    assert [losses(run)[s] for s in range(1, STEPS + 1)] == [losses(straight)[s] for s in range(1, STEPS + 1)]


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(data, reference_run, tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    saved_run_copy(reference_run, run, 4, 6)
    common = {"train.steps": STEPS, "train.micro_batch": 8}
    # Roll back to step 4 and go another way (a requeue would then resume with train.resume=auto).
    back = train(1, tiny_overrides(data, run, **common, **{"train.resume": ckpt / "step_00000004",
                                                            "train.stop_at_step": 5, "train.lr": 1e-3}))
    assert "set aside the later checkpoints step_00000006" in back.stdout
    (aside,) = (ckpt / "abandoned").iterdir()
    assert [d.name for d in aside.iterdir()] == ["step_00000006"] and (aside / "step_00000006" / "COMPLETE").is_file()
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000005"]
    # The run's config.yaml resumes it: relaunched as it is, it must not roll back again.
    from pretrain.config import load_config

    assert load_config(run / "config.yaml").train.resume == "auto"
    requeued = train(1, tiny_overrides(data, run, **common, **{"train.lr": 1e-3}))
    assert "step_00000005 at step 5" in requeued.stdout
    # Starting afresh in the run directory: its checkpoints would count against keep_last, and a
    # requeue without `latest` would resume the newest of them.
    fresh = train(1, tiny_overrides(data, run, **common, **{"train.resume": "none", "train.stop_at_step": 2}))
    aside = "starting afresh: set aside the checkpoints step_00000004, step_00000005, step_00000006"
    assert aside in fresh.stdout
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002"]
    assert (ckpt / "latest").read_text() == "step_00000002" and len(list((ckpt / "abandoned").iterdir())) == 2


def test_resume_auto_ignores_partial_checkpoint(data, reference_run, tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    saved_run_copy(reference_run, run, 4)  # as if stopped at step 4
    common = {"train.steps": 8, "train.micro_batch": 8}
    # The same job again (a requeue): resumed at stop_at_step, it trains nothing.
    again = train(1, tiny_overrides(data, run, **common, **{"train.stop_at_step": 4}))
    assert "nothing to train" in again.stdout and not (run / "losses.jsonl").exists()
    # So does a resume with train.steps below the checkpoint's step, and says so.
    lower = train(1, tiny_overrides(data, run, **{**common, "train.steps": 3}))
    assert "resumed at step 4, past train.steps=3: nothing to train" in lower.stdout
    finished = train(1, tiny_overrides(data, run, **{**common, "train.steps": 4}))  # a finished run again
    assert "resumed at step 4 = train.steps, the run's end: nothing to train" in finished.stdout
    # A copy that lost a file keeps its COMPLETE marker: refused before anything is built, naming it.
    copy = tmp_path / "copy"
    tag = saved_run_copy(reference_run, copy, 4)
    (optim,) = tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
    optim.unlink()
    lost = train(1, tiny_overrides(data, copy, **common), check=False)
    assert lost.returncode != 0 and f"is missing 1 file(s): [bf16_]{optim.name.removeprefix('bf16_')}" in lost.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004"]
    # A save killed halfway: files copied but truncated, no COMPLETE marker, pointer moved.
    partial = ckpt / "step_00000006"
    shutil.copytree(ckpt / "step_00000004", partial)
    (partial / "COMPLETE").unlink()
    for f in partial.glob("*.pt"):
        f.write_bytes(f.read_bytes()[:100])
    (ckpt / "latest").write_text("step_00000006")
    # And a save of step 8 by more ranks that crashed: its files must not mix with the next save of step 8.
    stale = ckpt / "step_00000008"
    stale.mkdir()
    (stale / "rank_00003.pt").write_bytes(b"stale")
    out = train(1, tiny_overrides(data, run, **common))
    assert "resumed from" in out.stdout and "step_00000004" in out.stdout
    assert (stale / "COMPLETE").is_file() and not (stale / "rank_00003.pt").exists()
    assert sorted(losses(run)) == list(range(5, 9))
    assert (ckpt / "step_00000008" / "COMPLETE").is_file()
    assert (ckpt / "latest").read_text() == "step_00000008"
    assert not partial.exists()  # leftovers of the crashed save are cleaned up


def _tree_digest(path) -> dict:
    import hashlib

    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*"))
            if f.is_file()}




@pytest.mark.slow
def test_resume_on_another_layout_continues_the_loss_curve(data, reference_run, data_parallel_run, tmp_path):
    """Saved at DP=2 (ZeRO-1, and ZeRO-3) and resumed at DP=1, saved at TP=1 and resumed at TP=2, all
    with the global batch kept: the steps after the resume give the uninterrupted single-process losses, so
    weights, Adam moments, schedule and sample order all carried over."""
    reference = losses(reference_run)
    for name, saved_run, (resumed_nproc, resumed) in (
            ("dp2_to_dp1", data_parallel_run(1), (1, {"train.micro_batch": 8})),
            ("zero3_dp2_to_dp1", data_parallel_run(3), (1, {"train.micro_batch": 8, "parallel.zero_stage": 3})),
            ("tp1_to_tp2", reference_run, (2, {"train.micro_batch": 8, "parallel.tensor": 2}))):
        run = tmp_path / name
        tag = saved_run_copy(saved_run, run, 4)
        before = _tree_digest(tag)
        out = train(resumed_nproc, tiny_overrides(data, run, **{"train.steps": STEPS, **resumed}))
        assert f"resumed from {tag} at step 4 on another layout" in out.stdout, out.stdout[-2000:]
        got = losses(run)
        assert sorted(got) == [5, 6]
        for step in got:
            assert got[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (name, step)
        assert _tree_digest(tag) == before  # the original is never changed
        assert (run / "checkpoints" / "universal" / "step_00000004" / "CONVERTED").is_file()
        if name == "dp2_to_dp1":  # another run's checkpoint: converted into this run, not beside it
            other = tmp_path / "other"
            out = train(1, tiny_overrides(data, other, **{"train.steps": STEPS, **resumed, "train.resume": str(tag)}))
            assert f"to a universal checkpoint in {other / 'checkpoints' / 'universal' / 'step_00000004@'}" in out.stdout
            assert losses(other) == got and _tree_digest(tag) == before
            # removed once this run has a checkpoint of its own
            assert not list((other / "checkpoints" / "universal").glob("*@*"))
        if name.startswith("zero3"):  # each parameter group kept its own weight decay (the norms none)
            import torch

            optim = run / "checkpoints" / "step_00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
            groups = torch.load(optim, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
            assert [(g["name"], g["weight_decay"]) for g in groups["param_groups"]] == [("decay", 0.1),
                                                                                         ("no_decay", 0.0)]


def test_checkpoint_from_another_model_is_rejected(data, reference_run, tmp_path):
    run = tmp_path / "run"
    tag = saved_run_copy(reference_run, run, 4)  # trained at world 1, micro-batch 8
    out = train(1, tiny_overrides(data, run, **{"train.steps": 8, "train.micro_batch": 8, "model.hidden_size": 32}),
                check=False)
    assert out.returncode != 0
    assert "belongs to another model" in out.stderr and "hidden_size" in out.stderr
    # A marker written before a model key existed matches that key's default, and only it.
    from pretrain.checkpoint import CheckpointError, check_compatible, read_meta
    from pretrain.config import load_config

    # A layout change that cannot resume is refused before any process group or model is built (exit 2).
    out = train(2, tiny_overrides(data, run, **{"train.steps": 8, "train.micro_batch": 8}), check=False)
    assert out.returncode != 0 and "model:" not in out.stdout
    assert (f"checkpoint {tag} was trained with a global batch of 8 samples (at world 1 = tensor 1 x data 1); "
            "this run's is 16") in out.stderr and f"train.init_from={tag}" in out.stderr
    from pretrain.checkpoint_format import check_layout

    saved = {"world_size": 2, "tensor_parallel": 2, "expert_parallel": 1, "global_batch": 8}
    assert check_layout(saved, 2, 2, 8, False, tag) is False
    assert check_layout(saved, 2, 1, 8, False, tag) is True  # TP 2 -> 1 at the same global batch: converted
    # Routed experts: at another world size loaded as they are (moments fresh); another tensor split refused
    assert check_layout(saved, 4, 2, 8, True, tag) is False
    with pytest.raises(CheckpointError, match="routed experts resumes at the saved tensor-parallel size and "
                                              "precision only"):
        check_layout(saved, 2, 1, 8, True, tag)
    # A run directory where a checkpoint goes: its newest named, and the run's own resume.
    from pretrain.checkpoint_format import resolve_resume

    with pytest.raises(CheckpointError, match=rf"train.resume={reference_run} is a run directory; give one of its "
                                              rf"checkpoints, e.g. train.resume={reference_run}/checkpoints/step_"):
        resolve_resume(str(reference_run), str(run))
    with pytest.raises(CheckpointError, match="records no layout"):
        check_layout({"world_size": 2}, 1, 1, 8, False, tag)  # a marker from before layouts were recorded
    # ZeRO-1 and 2 share their files; 0 and 3 have files of their own, which load at their stage only.
    assert check_layout({**saved, "zero_stage": 1}, 2, 2, 8, False, tag, zero_stage=2) is False
    assert check_layout(saved, 2, 2, 8, False, tag, zero_stage=2) is False  # a marker without its stage
    for stage in (0, 3):
        with pytest.raises(CheckpointError, match=f"saved at ZeRO-1 or 2, this run asks for parallel.zero_stage="
                                                  f"{stage}: its files load at ZeRO-1 or 2 only"):
            check_layout({**saved, "zero_stage": 1}, 2, 2, 8, False, tag, zero_stage=stage)
    # A marker without its stage: told by the files (the tag is a ZeRO-1 save).
    with pytest.raises(CheckpointError, match="saved at ZeRO-1 or 2, this run asks for parallel.zero_stage=3"):
        check_layout(saved, 2, 2, 8, False, tag, zero_stage=3)
    with pytest.raises(CheckpointError, match="saved at ZeRO-1 or 2, this run asks for parallel.zero_stage=0"):
        check_layout(saved, 2, 2, 8, False, tag, zero_stage=0)
    weights_only = {**saved, "zero_stage": 1, "optimizer_state": False}  # tools.import_hf: loads at ZeRO 0-2
    assert check_layout(weights_only, 2, 2, 8, False, tag, zero_stage=0) is False
    with pytest.raises(CheckpointError, match="this run asks for parallel.zero_stage=3"):
        check_layout(weights_only, 2, 2, 8, False, tag, zero_stage=3)
    # Another precision at the saved layout: bf16 runs name their ZeRO files otherwise, so the
    # resume goes through a universal checkpoint (the tag is an fp32 save; older markers: by the files).
    assert check_layout(saved, 2, 2, 8, False, tag, bf16=True) is True
    assert check_layout({**saved, "bf16": True}, 2, 2, 8, False, tag, bf16=True) is False
    assert check_layout(saved, 2, 2, 8, False, tag, bf16=False) is False
    assert check_layout(weights_only, 2, 2, 8, False, tag, bf16=True) is False
    # ZeRO-0 keeps its optimizer state in the model files whatever the precision: an older marker tells none
    assert check_layout({k: v for k, v in saved.items() if k != "zero_stage"} | {"zero_stage": 0}, 2, 2, 8, False,
                        tag, zero_stage=0, bf16=True) is False
    with pytest.raises(CheckpointError, match=r"saved at world 2 = tensor 2 x data 1 in fp32, this run asks for world "
                                              r"2 = tensor 2 x data 1 in bf16: a model with routed experts"):
        check_layout(saved, 2, 2, 8, True, tag, bf16=True)
    meta = read_meta(tag)
    del meta["model"]["num_kv_heads"]
    model = load_config(None, tiny_overrides(data, run)).to_dict()["model"]
    check_compatible(meta, model, None, tag)
    with pytest.raises(CheckpointError, match="num_kv_heads: checkpoint 4 vs config 2"):  # 0: one per head
        check_compatible(meta, {**model, "num_kv_heads": 2}, None, tag)
    check_compatible(meta, {**model, "num_kv_heads": model["num_heads"]}, None, tag)
    # The same layers spelled another way are the same model.
    check_compatible(meta, {**model, "attention": "ss"}, None, tag)
    check_compatible(meta, {**model, "attention": ["softmax", "softmax"]}, None, tag)
    with pytest.raises(CheckpointError, match="attention: checkpoint 'softmax,softmax' vs config 'softmax,relu'"):
        check_compatible(meta, {**model, "attention": "sr"}, None, tag)


def test_markers_without_their_zero_stage_are_told_by_their_files(tmp_path):
    from pretrain.checkpoint_format import saved_zero_family

    layouts = {"0": ["mp_rank_00_model_states.pt"],
               "1-2": ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
               "1-2 bf16": ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
               "3": ["zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]}
    for family, files in layouts.items():
        tag = tmp_path / family.replace(" ", "_")
        tag.mkdir()
        for name in files:
            (tag / name).write_bytes(b"")
        assert saved_zero_family({"world_size": 1}, tag) == family.split()[0], family
    assert saved_zero_family({"world_size": 1, "zero_stage": 2}, tmp_path / "0") == "1-2"  # recorded: believed
    assert saved_zero_family({"world_size": 1}, tmp_path) is None  # no DeepSpeed files: nothing to tell by


def test_a_save_keeps_the_last_complete_checkpoints_and_clears_older_partial_ones(tmp_path):
    """train.keep_last complete checkpoints stay, the cached universal conversions of the others go
    with them; partial ones older than the save are crashed saves' leftovers."""
    from pretrain.checkpoint import _prune

    def tag(step: int, complete: bool = True):
        (tmp_path / f"step_{step:08d}").mkdir()
        if complete:
            (tmp_path / f"step_{step:08d}" / "COMPLETE").write_text("{}")

    for step in (1, 2, 4, 5):
        tag(step)
    tag(3, complete=False)  # a crashed save
    tag(6, complete=False)  # one being written after this save (not older: kept)
    (tmp_path / "universal" / "step_00000001").mkdir(parents=True)
    (tmp_path / "universal" / "step_00000004").mkdir()
    (tmp_path / "universal" / "step_00000009@0123abcd").mkdir()  # another run's checkpoint this one resumed
    _prune(tmp_path, keep_last=2, keep="step_00000005")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005", "step_00000006"]
    assert [p.name for p in (tmp_path / "universal").iterdir()] == ["step_00000004"]
    tag(7)
    _prune(tmp_path, keep_last=1, keep="step_00000007")  # the partial 6 is older now
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000007"]
    # train.keep_every: the multiples of it stay beyond keep_last, as the permanent record of a run
    for step in (8, 9, 10, 11, 12):
        tag(step)
    _prune(tmp_path, keep_last=2, keep="step_00000012", keep_every=4)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000008", "step_00000011", "step_00000012"]


def test_a_save_by_time_is_due_once_the_minutes_passed_since_the_last_save():
    from pretrain.save_timer import SaveTimer

    now = [100.0]
    timer = SaveTimer(2, clock=lambda: now[0])
    now[0] = 219.0
    assert not timer.due()
    now[0] = 220.0
    assert timer.due() and timer.due()  # until a save resets it
    timer.saved()
    now[0] = 339.0
    assert not timer.due()
    assert not SaveTimer(0, clock=lambda: now[0] + 1e9).due()  # 0: off


def _save_due_on_either_rank(rank: int) -> None:
    from pretrain.save_timer import SaveTimer

    now = [0.0]
    timer = SaveTimer(1, clock=lambda: now[0])
    now[0] = 60.0 if rank == 0 else 59.0  # clocks a second apart: due on rank 0 only
    assert timer.due()  # on both: every rank saves at the same step


def test_ranks_agree_on_a_save_by_time():
    from tests.dist_utils import spawn

    spawn(_save_due_on_either_rank, 2)


def test_a_checkpoint_missing_one_expert_file_is_told_by_its_name(tmp_path):
    """Every expert file a routed model's checkpoint needs: DeepSpeed numbers them by routed layer
    (model.moe.moe_layers 1,3 -> layer_0, layer_1), global expert and tensor-parallel rank."""
    from models.config import ModelConfig
    from models.moe.routing import MoEConfig
    from pretrain.consolidate import ConsolidateError, describe_layout

    model = ModelConfig(mlp="moe", num_layers=4, moe=MoEConfig(num_experts=4, moe_layers="1,3")).to_dict()
    meta = {"model": model, "world_size": 2, "tensor_parallel": 1}
    for name in ["rank_00000.pt", "rank_00001.pt", "mp_rank_00_model_states.pt",
                 *(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4))]:
        (tmp_path / name).write_bytes(b"")
    assert describe_layout(tmp_path, meta)["experts"]
    (tmp_path / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ConsolidateError, match=r"is missing 1 file\(s\): layer_1_expert_3_mp_rank_00_model_states.pt"):
        describe_layout(tmp_path, meta)
    for lost in tmp_path.glob("layer_*"):  # a copy that lost them all
        lost.unlink()
    with pytest.raises(ConsolidateError, match=r"is missing 8 file\(s\): layer_0_expert_0_mp_rank_00"):
        describe_layout(tmp_path, meta)


COSINE = [0.5, 1.0, 0.9657, 0.8682, 0.7222, 0.55, 0.3778, 0.2318, 0.1343, 0.1]
WSD = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]
WSD_SQRT = WSD[:7] + [0.4804, 0.2652, 0.1]


def test_schedule_rates_and_config_errors():
    """Every step's rate over train.lr (10 steps, 2 of warmup, min_lr_ratio 0.1): warmup from the
    first step, cosine to the floor at the last step; wsd at the full rate until its decay window
    (the last 30% here), linear or 1 - sqrt."""
    from pretrain.config import ConfigError, TrainConfig, load_config, validate
    from pretrain.schedule import lr_multiplier

    base = dict(steps=10, warmup_steps=2, min_lr_ratio=0.1, decay_fraction=0.3)
    for extra, want in (({}, COSINE), ({"schedule": "wsd"}, WSD),
                        ({"schedule": "wsd", "decay_shape": "sqrt"}, WSD_SQRT)):
        t = TrainConfig(**base, **extra)
        assert [round(lr_multiplier(i, t), 4) for i in range(10)] == want, extra
    no_warmup = TrainConfig(steps=4, warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_multiplier(i, no_warmup) for i in range(4)] == pytest.approx([0.8536, 0.5, 0.1464, 0.0], abs=1e-4)
    for overrides, match in ((["train.schedule=linear"], "train.schedule='linear': choose one of"),
                             (["train.schedule=wsd", "train.decay_fraction=0"], "decay_fraction=0.0 must be in"),
                             (["train.schedule=wsd", "train.decay_shape=exp"], "decay_shape='exp'"),
                             (["train.schedule=wsd", "train.steps=10", "train.warmup_steps=5",
                               "train.decay_fraction=0.6"], "plus the 6 decay steps"),
                             (["train.lr=inf"], "train.lr=inf must be a finite number"),
                             (["train.grad_clip=nan"], "train.grad_clip=nan must be a finite number"),
                             (["train.skip_spikes=true", "train.spike_sigmas=nan"], "train.spike_sigmas=nan"),
                             (["data.mix=[{shards: a, weight: .inf}, {shards: b}]"], r"data.mix\[0\].weight=inf")):
        with pytest.raises(ConfigError, match=match):
            validate(load_config(None, overrides), world_size=1)
    # Warmup ending where the decay starts fits exactly: full rate at its last warmup step only.
    from pretrain.schedule import validate_schedule

    edge = TrainConfig(steps=10, warmup_steps=7, schedule="wsd", decay_fraction=0.3, min_lr_ratio=0.1)
    validate_schedule(edge)
    assert [round(lr_multiplier(i, edge), 4) for i in range(6, 10)] == [1.0, 0.7, 0.4, 0.1]
    with pytest.raises(ConfigError, match="warmup_steps=8 plus the 3 decay steps"):
        validate_schedule(TrainConfig(steps=10, warmup_steps=8, schedule="wsd", decay_fraction=0.3))


def test_schedule_takes_the_step_count_of_deepspeed_cosine_state():
    """Checkpoints written with DeepSpeed's WarmupCosineLR hold {"last_batch_iteration": n - 1} after
    n steps (it counts from -1): the schedule continues from step n at this config's rates."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from pretrain.config import TrainConfig
    from pretrain.schedule import LRSchedule

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    old = WarmupCosineLR(optimizer, total_num_steps=10, warmup_num_steps=2)
    for _ in range(5):  # five steps taken before the checkpoint
        optimizer.step()
        old.step()
    t = TrainConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1, lr=1.0)
    scheduler = LRSchedule(optimizer, t)
    scheduler.load_state_dict(old.state_dict())
    scheduler.follow_config()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(COSINE[5], abs=1e-4)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(COSINE[6], abs=1e-4)


def logged_lrs(run) -> dict[int, float]:
    records = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["train/lr"] for r in records if "train/lr" in r}


def test_a_batch_ramp_trains_each_step_as_a_run_at_that_batch_would(data, tmp_path):
    """train.batch_ramp_*: the first step at 4 samples (one micro-batch of the 2 grad_accum gives),
    then 8: the losses and gradient norms of a run at grad_accum 1 for one step, resumed at grad_accum
    2 (the same samples: the data position counts samples). DeepSpeed is told where each step's
    accumulation ends: counting micro-batches since the start, it would step after the first one of
    step 2."""
    ramp, ref = tmp_path / "ramp", tmp_path / "ref"
    common = {"train.steps": 3, "train.grad_clip": 0.05, "train.eval_interval": 3, "train.save_interval": 3}
    train(1, tiny_overrides(data, ramp, **common, **{"train.grad_accum": 2, "train.batch_ramp_start": 4,
                                                     "train.batch_ramp_steps": 1}))
    train(1, tiny_overrides(data, ref, **common, **{"train.grad_accum": 1, "train.stop_at_step": 1}))
    train(1, tiny_overrides(data, ref, **common, **{"train.grad_accum": 2}))
    assert losses(ramp) == losses(ref) and sorted(losses(ramp)) == [1, 2, 3]
    assert grad_norms(ramp) == grad_norms(ref)
    assert [r["train/global_batch"] for r in records_of(ramp) if "train/loss" in r] == [4, 8, 8]
    assert [r["train/tokens_seen"] for r in records_of(ramp) if "train/loss" in r] == [128, 384, 640]  # 32 per sample


def test_batch_ramp_sizes_grow_linearly_in_whole_micro_batches():
    from pretrain.batch_ramp import micro_batches_at
    from pretrain.config import TrainConfig

    t = TrainConfig(micro_batch=2, grad_accum=8, batch_ramp_start=8, batch_ramp_steps=4, steps=10)
    # 8 samples on 2 ranks (2 micro-batches of 2 each), growing to 32 (8 each) over 4 steps
    assert [micro_batches_at(step, t, 2) for step in range(1, 7)] == [2, 3, 5, 6, 8, 8]
    assert micro_batches_at(1, TrainConfig(grad_accum=3), 4) == 3  # no ramp
    assert micro_batches_at(1, t, 8) == 1  # resumed on 8 ranks: 8 samples are less than a micro-batch each


def test_wsd_run_resumes_exactly_and_extends(data, tmp_path):
    """The logged rate is the one each step applied. A wsd run stopped at step 5 and resumed gives
    the uninterrupted losses bitwise; resumed with train.steps=14 instead, it stays at the full rate
    through step 10 (the same losses until the 10-step run's decay shows) and decays over the last
    30% of the 14 steps."""
    lr = 3e-3
    common = {"train.steps": 10, "train.warmup_steps": 2, "train.schedule": "wsd", "train.decay_fraction": 0.3,
              "train.lr": lr, "train.save_interval": 5}
    full, resumed, extended = tmp_path / "full", tmp_path / "resumed", tmp_path / "extended"
    train(1, tiny_overrides(data, full, **common))
    train(1, tiny_overrides(data, resumed, **common, **{"train.stop_at_step": 5}))
    shutil.copytree(resumed, extended)
    out = train(1, tiny_overrides(data, resumed, **common))
    assert "resumed from" in out.stdout
    assert logged_lrs(full) == pytest.approx({k + 1: lr * m for k, m in enumerate(WSD)}, rel=1e-6)
    assert losses(resumed) == losses(full) and logged_lrs(resumed) == logged_lrs(full)

    train(1, tiny_overrides(data, extended, **{**common, "train.steps": 14}))
    want = [1.0] * 5 + [0.775, 0.55, 0.325, 0.1]
    lrs = logged_lrs(extended)
    assert [lrs[s] for s in range(6, 15)] == pytest.approx([lr * m for m in want], rel=1e-6)
    got, reference = losses(extended), losses(full)
    # A step's loss is taken before its update: the 10-step run's first decayed step (8) shows at 9.
    assert [got[s] for s in range(1, 9)] == [reference[s] for s in range(1, 9)]
    assert got[9] != reference[9]


def profiled_steps(trace) -> list[str]:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    names = [event.get("name", "") for event in events]
    assert any(name.startswith("aten::") and "mm" in name for name in names), trace  # the model's matmuls
    steps = sorted(name for name in set(names) if name.startswith("ProfilerStep#"))
    # one training forward per step (micro-batch 4, one per rank); validation and saves are not recorded
    assert names.count("_VocabParallelCrossEntropy") == len(steps), (trace, names.count("_VocabParallelCrossEntropy"))
    return steps


def test_profiler_traces_the_chosen_steps_across_a_resume(resumed_run):
    """profile.start_step=3 steps=3 is steps 3-5: the first run stops after step 4, so it writes
    steps 3-4 (after warming up in step 2); the resumed run profiles the rest, step 5, on both ranks."""
    _, run, first, second = resumed_run
    rank1_log = (run / "logs" / "rank1.log").read_text()  # ranks other than 0 write there, not to the console
    for out, steps in ((first, "3-4"), (second, "5-5")):
        assert f"rank 0: profile of steps {steps} written" in out.stdout, out.stdout
        assert f"rank 1: profile of steps {steps} written" in rank1_log and "rank 1:" not in out.stdout
    files = sorted(p.name for p in (run / "profile").iterdir())
    assert files == [f"rank{r}_steps{s}.{ext}" for r in (0, 1) for s in ("3-4", "5-5") for ext in ("json.gz", "txt")]
    for rank in (0, 1):
        assert len(profiled_steps(run / "profile" / f"rank{rank}_steps3-4.json.gz")) == 2
        assert len(profiled_steps(run / "profile" / f"rank{rank}_steps5-5.json.gz")) == 1
        assert "Self CPU" in (run / "profile" / f"rank{rank}_steps3-4.txt").read_text()
    assert sorted(losses(run)) == list(range(1, 9))


def test_mixture_resumes_exactly_and_validates_each_source(tmp_path):
    web = write_synthetic_shards(tmp_path / "web", seed=0)
    code = write_synthetic_shards(tmp_path / "code", seed=1000)
    mix = f"[{{shards: {web / 'shards'}, weight: 3, name: web}}, {{shards: {code / 'shards'}, name: code}}]"
    # A held-out set validated beside them (all of it: built with --val-fraction 0), not trained on
    held = write_synthetic_shards(tmp_path / "held", train=8, val=0, seed=2000)
    (held / "shards" / "val" / "index.json").unlink(missing_ok=True)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = {"data.mix": mix, "train.steps": 8, "train.eval_interval": 8,
              "eval.val_sets": f"[{{shards: {held / 'shards'}, name: held}}]"}
    train(2, tiny_overrides(web, straight, **common))
    train(2, tiny_overrides(web, resumed, **common, **{"train.stop_at_step": 4}))
    out = train(2, tiny_overrides(web, resumed, **common))
    want, got = losses(straight), losses(resumed)
    assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # bitwise on CPU
    [val] = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()
             if "val/loss" in line]
    assert val["step"] == 8 and {"val/web/loss", "val/code/loss", "val/held/loss"} <= set(val)
    from pretrain.config import load_config

    assert load_config(resumed / "config.yaml").eval.val_sets[0].name == "held"  # the saved config loads
    # Equal numbers of batches per source: the overall loss is the mean of the two training sources'.
    assert val["val/loss"] == pytest.approx((val["val/web/loss"] + val["val/code/loss"]) / 2, rel=1e-6)
    assert abs(val["val/held/loss"] - val["val/loss"]) > 1e-3
    assert f"val loss {val['val/loss']:.4f} (web {val['val/web/loss']:.4f}, code {val['val/code/loss']:.4f}, " \
           f"held {val['val/held/loss']:.4f})" in out.stdout


def test_a_checkpoint_is_removed_marker_first(tmp_path, monkeypatch):
    """Retention and a save over an earlier one of the same step delete the COMPLETE marker before
    the files: a process killed part-way leaves a partial checkpoint, never a complete-looking one."""
    import pretrain.checkpoint as checkpoint
    from pretrain.checkpoint_format import COMPLETE

    tag = tmp_path / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (tag / COMPLETE).write_text("{}")
    (tag / "mp_rank_00_model_states.pt").write_text("")

    def killed(path, ignore_errors=False):
        raise KeyboardInterrupt  # the process dies inside the removal

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.remove_checkpoint(tag)
    assert not (tag / COMPLETE).exists() and (tag / "mp_rank_00_model_states.pt").exists()


def test_a_resume_on_changed_train_data_starts_a_new_epoch(data, tmp_path):
    """The checkpoint records the train data (sources, weights, each local split's index); resumed
    on other data (here a second source mixed in) the saved position would point into another epoch
    order, so the loader starts the next epoch, and says so. (The same data resumes in place: the
    resume tests above reproduce the uninterrupted losses.)"""
    other = write_synthetic_shards(tmp_path / "other", seed=7)
    run = tmp_path / "run"
    train(1, tiny_overrides(data, run, **{"train.steps": 6, "train.stop_at_step": 2}))
    mix = f"data.mix=[{{shards: {data / 'shards'}, name: web}}, {{shards: {other / 'shards'}, name: other}}]"
    changed = train(1, tiny_overrides(data, run, **{"train.steps": 6}) + [mix])
    assert "the train data changed since the checkpoint" in changed.stdout, changed.stdout[-2000:]
    assert "starting epoch 1 of it from its first sample" in changed.stdout
    assert sorted(losses(run))[-1] == 6


def test_resuming_another_runs_checkpoint_sets_this_runs_own_aside(tmp_path):
    """Their higher tags would count against keep_last and be resumed by a requeue before the first save."""
    from pretrain.checkpoint_format import set_aside_newer

    for run, step in (("run", 4), ("run", 8), ("other", 2)):
        tag = tmp_path / run / "checkpoints" / f"step_{step:08d}"
        tag.mkdir(parents=True)
        (tag / "COMPLETE").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000008")
    other = tmp_path / "other" / "checkpoints" / "step_00000002"
    assert set_aside_newer(tmp_path / "run", other) == ["step_00000004", "step_00000008"]
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists() and (other / "COMPLETE").is_file()


def test_a_one_source_mixture_reports_its_source_by_name():
    """val/<name>/loss for every data.mix source, also when one alone has a validation split."""
    import types

    import torch

    from pretrain.trainer import Trainer
    from tests.dist_utils import single_process_group

    from pretrain.config import load_config

    trainer = object.__new__(Trainer)
    trainer.device, trainer.cfg = "cpu", load_config(None, ["eval.val_sets=[{shards: data/c4, name: c4}]"])
    trainer.engine = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
    trainer.forward = lambda batch: torch.tensor(float(batch))
    trainer.loss_tokens = lambda batch: None
    with single_process_group():
        for val_sets, want in (({"web": [1.0, 3.0]}, {"loss": 2.0, "web/loss": 2.0}),
                               ({"": [1.0, 3.0]}, {"loss": 2.0}),
                               # a held-out set (eval.val_sets) is reported by name, out of "loss"
                               ({"": [1.0, 3.0], "c4": [5.0, 7.0]}, {"loss": 2.0, "c4/loss": 6.0}),
                               ({"c4": [5.0, 7.0]}, {"loss": 6.0, "c4/loss": 6.0})):  # no other: "loss" is its
            trainer.val_sets = val_sets
            assert trainer.evaluate() == pytest.approx(want), val_sets


# pretrain.train where rank 1 resolves train.init_from to a newer checkpoint than rank 0, as when the
# source run saves between the ranks' starts; each rank prints the weights it loads.
SPLIT_START_TRAIN = """
import os, sys
import pretrain.init_from as init_from
from pretrain.train import Task, main

resolve = init_from.check_source

def per_rank(source, *args, **kwargs):
    return resolve(source if os.environ["RANK"] == "0" else os.environ["NEWER"], *args, **kwargs)

init_from.check_source = per_rank

class Printing(Task):
    def load_init(self, model, path):
        print(f"rank {os.environ['RANK']} loads {path}", flush=True)
        super().load_init(model, path)

sys.exit(main(sys.argv[1:], Printing()))
"""


def test_every_rank_starts_from_the_checkpoint_rank_0_found(data, reference_run, tmp_path):
    script = tmp_path / "split_start.py"
    script.write_text(SPLIT_START_TRAIN)
    older, newer = (reference_run / "checkpoints" / f"step_{step:08d}" for step in (4, 6))
    overrides = tiny_overrides(data, tmp_path / "run", **{"train.steps": 3, "train.stop_at_step": 1,
                                                           "train.init_from": str(older)})
    out = torchrun(2, [str(script), *overrides], NEWER=str(newer))
    assert f"rank 0 loads {older}" in out.stdout and f"rank 1 loads {older}" in out.stdout, out.stdout


def test_a_run_resumes_in_another_precision(data, tmp_path):
    """A bf16 run resumed in fp32 (after an instability, or bf16 on the GPU and fp32 elsewhere):
    its ZeRO files go by other names, so the resume goes through a universal checkpoint and the
    run trains on from the saved step."""
    run = tmp_path / "run"
    common = {"train.steps": 6, "train.save_interval": 4}
    train(1, tiny_overrides(data, run, **common, **{"train.precision": "bf16", "train.stop_at_step": 4}))
    assert any((run / "checkpoints" / "step_00000004").glob("bf16_zero_pp_rank_*"))
    out = train(1, tiny_overrides(data, run, **common, **{"train.precision": "fp32"}))
    assert "at step 4 on another layout, through" in out.stdout, out.stdout[-3000:]
    assert sorted(losses(run))[-1] == 6


def test_readers_of_a_bf16_run_get_its_fp32_master_weights(data, tmp_path):
    """A bf16 run at ZeRO-1 over two data-parallel ranks: the consolidated weights (what export,
    init_from and the other readers take) are its fp32 masters, joined from both optimizer partitions,
    as DeepSpeed's own universal conversion reads them, not the bf16 copies the model holds."""
    import torch

    from pretrain.consolidate import full_state_dict
    from pretrain.universal import convert

    run = tmp_path / "run"
    train(2, tiny_overrides(data, run, **{"train.steps": 4, "train.save_interval": 4, "train.micro_batch": 2,
                                          "train.precision": "bf16"}))
    tag = run / "checkpoints" / "step_00000004"
    state, _, _ = full_state_dict(tag)
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    universal = convert(tag, run) / "zero"
    compared = 0
    for folder in universal.iterdir():
        if (folder / "fp32.pt").is_file():
            master = torch.load(folder / "fp32.pt", weights_only=False)
            master = master["param"] if isinstance(master, dict) else master
            assert torch.equal(state[folder.name].flatten(), master.flatten()), folder.name
            assert module[folder.name].dtype == torch.bfloat16
            compared += 1
    assert compared == len([k for k in state if not k.endswith("_extra_state")]) > 10
    assert any(not torch.equal(state[k], module[k].float()) for k in state)  # finer than the bf16 copies


def test_a_synthetic_data_run_reads_no_shards_saves_by_time_and_resumes_exactly(tmp_path):
    """data.synthetic: random tokens, no shards or tokenizer needed (a smoke test of a config); the
    loss starts near ln(vocab_size), and a stopped run resumes to the uninterrupted run's losses.
    train.save_interval_minutes saves between the train.save_interval steps; train.stop_after_minutes
    saves and stops as a time-limit signal does."""
    import math
    import subprocess
    import sys

    from tests.dist_utils import REPO, child_env, free_port

    straight, part = tmp_path / "straight", tmp_path / "part"
    held = write_synthetic_shards(tmp_path / "held", train=8, val=4)  # a held-out set validated beside them
    extra = {"data.synthetic": "true", "data.shards": tmp_path / "none", "data.tokenizer": held / "tokenizer",
             "train.steps": 4, "train.save_interval": 4, "train.save_interval_minutes": "1e-9",
             "train.eval_interval": 4,
             "eval.val_sets": f"[{{shards: {held / 'shards'}}}]"}
    out = train(1, tiny_overrides(tmp_path, straight, **extra))
    assert "read with data.synthetic=false only" in out.stdout
    assert [r["step"] for r in records_of(straight) if "checkpoint/save_s" in r] == [1, 2, 3, 4]  # by time, 4 by steps
    assert out.stdout.count("min since the last save (train.save_interval_minutes)") == 3
    saved_run_copy(straight, part, 2)  # as if stopped after the save of step 2
    # train.stop_after_minutes: saved and stopped at the first step boundary after the time passed;
    # launch.local exits with the trainer's code for that, 85
    # launch.local exits with the trainer's code for that, 85. Here step 3 is the run's last
    # (stop_at_step) and the time cut its validation short: it stops as on any signal, not as done.
    last_step = {"train.stop_after_minutes": "1e-9", "train.stop_at_step": 3, "train.eval_interval": 3}
    local = [sys.executable, "-m", "launch.local", "--port", str(free_port()),
             *tiny_overrides(tmp_path, part, **{**extra, **last_step})]
    stopped = subprocess.run(local, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 85, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "stopping at step 3 on train.stop_after_minutes=1e-09 passed" in stopped.stdout
    assert "val loss" not in stopped.stdout
    assert json.loads((part / "STOPPED_ON_SIGNAL").read_text())["signal"] == "SIGALRM"
    resumed = train(1, tiny_overrides(tmp_path, part, **extra))
    assert "resumed from" in resumed.stdout and losses(part) == {s: losses(straight)[s] for s in (3, 4)}
    assert "step 3: running the validation the stop interrupted" in resumed.stdout
    # tokens trained on, kept in the checkpoint: 4 samples of 32 a step
    assert [r["train/tokens_seen"] for r in records_of(part) if "train/loss" in r] == [384, 512]
    assert [r["step"] for r in records_of(part) if "val/loss" in r] == [3, 4]
    assert sorted(losses(straight)) == [1, 2, 3, 4] and abs(losses(straight)[1] - math.log(256)) < 0.3
    [val] = [r for r in records_of(straight) if "val/loss" in r]
    assert abs(val["val/loss"] - math.log(256)) < 0.3 and {"val/shards/loss", "val/loss"} <= set(val)
    assert "val//loss" not in val and " ( " not in out.stdout  # the training data's is val/loss alone
