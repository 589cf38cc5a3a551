"""Loss-spike protection: the guard's decisions, an optimizer step that changes nothing when skipped,
and a training run (DP=2) whose planted spikes are skipped on every rank and resume exactly."""

from __future__ import annotations

import json
from statistics import fmean, pstdev

import pytest
import torch

from pretrain.spikes import MAX_CONSECUTIVE_SKIPS, MIN_STEPS, SkipStepAdamW, SpikeGuard
from tests.dist_utils import saved_run_copy, torchrun, train
from tests.synthetic import tiny_overrides, write_synthetic_shards


def run_guard(guard: SpikeGuard, step: int, loss: float, grad_norm: float, calls: int = 2) -> str:
    guard.begin_step(loss)
    decisions = {guard.skip(grad_norm) for _ in range(calls)}  # one call per parameter group
    assert len(decisions) == 1
    return guard.end_step(step)


def test_guard_skips_what_is_sigmas_above_the_window_and_only_that():
    guard = SpikeGuard(window=30, sigmas=3.0)
    values = [2.0 + 0.1 * ((-1) ** i) for i in range(MIN_STEPS)]  # mean 2.0, std 0.1
    for step, v in enumerate(values, 1):
        assert run_guard(guard, step, v, 1.0 + v / 10) == ""
    assert run_guard(guard, 21, 2.29, 1.2) == ""  # below 2.0 + 3 x 0.1
    # The window now holds 2.29 too: mean + 3 population standard deviations of what it holds.
    losses, norms = [*values, 2.29], [*(1.0 + v / 10 for v in values), 1.2]
    limit = {name: fmean(xs) + 3 * pstdev(xs) for name, xs in (("loss", losses), ("grad", norms))}
    assert 2.36 < limit["loss"] < 2.37 and 1.22 < limit["grad"] < 1.24
    assert run_guard(guard, 22, 2.37, 1.2) == f"loss 2.3700 > {limit['loss']:.4f}"
    assert run_guard(guard, 23, 2.0, 1.24) == f"grad norm 1.2400 > {limit['grad']:.4f}"
    assert guard.skipped_steps == [22, 23] and len(guard.losses) == MIN_STEPS + 1  # skipped steps stay out
    copy = SpikeGuard(window=30, sigmas=3.0)
    copy.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert run_guard(copy, 24, 2.5, 1.2) == run_guard(guard, 24, 2.5, 1.2) != ""
    # A lasting jump is not skipped for ever: after MAX_CONSECUTIVE_SKIPS the window starts over.
    shifted = SpikeGuard(window=30, sigmas=3.0)
    shifted.load_state_dict({**guard.state_dict(), "consecutive": 0})
    reasons = [run_guard(shifted, 100 + i, 9.0, 1.0) for i in range(MAX_CONSECUTIVE_SKIPS + 1)]
    assert all(reasons[:-1]) and reasons[-1] == "" and len(shifted.losses) == 1
    assert run_guard(shifted, 200, 5.0, float("nan")).startswith("grad norm nan")  # never applied, never kept
    assert len(shifted.grad_norms) == 1
    # Nothing is judged before the window holds MIN_STEPS applied steps; from then on it is.
    fresh = SpikeGuard(window=30, sigmas=3.0)
    assert run_guard(fresh, 1, 2.0, 1.0) == run_guard(fresh, 2, 1e6, 1e6) == ""
    for step in range(3, MIN_STEPS + 1):
        assert run_guard(fresh, step, values[step % 2], 1.0) == ""
    assert len(fresh.losses) == MIN_STEPS and run_guard(fresh, MIN_STEPS + 1, 1e6, 1.0).startswith("loss")
    # A step whose optimizer never asked (DeepSpeed's own overflow skip) adds nothing to the window.
    fresh.begin_step(2.0)
    assert fresh.end_step(MIN_STEPS + 2) == "" and len(fresh.losses) == MIN_STEPS
    # Skips in a row survive a resume: the restart comes after MAX_CONSECUTIVE_SKIPS in all.
    resumed = SpikeGuard(window=30, sigmas=3.0)
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict() | {"consecutive": MAX_CONSECUTIVE_SKIPS})))
    assert run_guard(resumed, 300, 1e6, 1.0) == "" and resumed.restarted


def test_a_skipped_step_leaves_parameters_and_moments_alone():
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    opts = [torch.optim.AdamW(ref.parameters(), lr=0.1), SkipStepAdamW(model.parameters(), lr=0.1)]
    skip = [False]
    opts[1].should_skip = lambda: skip[0]
    x = torch.randn(8, 4)
    for step in range(4):
        skip[0] = step == 2
        for net, opt in zip((ref, model), opts):
            if net is ref and skip[0]:
                continue  # the reference simply has no step 2
            opt.zero_grad()
            net(x).square().sum().backward()
            if net is model and skip[0]:
                before = ([p.clone() for p in model.parameters()],
                          [s["exp_avg"].clone() for s in opt.state.values()])
                opt.step()
                assert opt.skipped  # what the trainer reads: the step moves no router bias either
                assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
                assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(before[1], opt.state.values()))
                continue
            opt.step()
            assert not getattr(opt, "skipped", False)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_planted_spikes_are_skipped_on_every_rank_and_resume_exactly(tmp_path):
    data = write_synthetic_shards(tmp_path / "data", garbage_every=37)
    extra = {"train.steps": 70, "train.skip_spikes": "true", "train.spike_sigmas": 4.0, "train.spike_window": 32,
             "train.eval_interval": 1000, "train.save_interval": 35, "train.log_interval": 1,
             "train.warmup_steps": 5}
    full, part = tmp_path / "full", tmp_path / "part"
    out = train(2, tiny_overrides(data, full, **extra))
    skipped = [int(line.split()[1].rstrip(":")) for line in out.stdout.splitlines() if "skipped as a spike" in line]
    assert len(skipped) >= 2 and all(s > 20 for s in skipped), out.stdout[-3000:]
    loss = {r["step"]: r["loss"] for r in map(json.loads, (full / "losses.jsonl").read_text().splitlines())}
    assert all(loss[s] > 1.3 * loss[s - 1] for s in skipped), (skipped, loss)  # each a jump: a planted batch
    ranks = [torch.load(full / "checkpoints" / "step_00000070" / f"rank_{r:05d}.pt", weights_only=False)["spikes"]
             for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["skipped_steps"] == skipped
    metrics = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("train/skipped_steps", 0) for m in metrics) == len(skipped)

    saved_run_copy(full, part, 35)  # as if stopped (or killed) after the save of step 35
    resumed = train(2, tiny_overrides(data, part, **extra))
    assert "resumed from" in resumed.stdout
    losses = {run: [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
              for run in (full, part)}
    assert losses[part] == losses[full][35:]  # bitwise: the same steps skipped, the same updates applied
    assert [int(line.split()[1].rstrip(":")) for line in resumed.stdout.splitlines()
            if "skipped as a spike" in line] == [s for s in skipped if s > 35]


# pretrain.train whose optimizer also skips the step SKIP_AT_STEP, as for a spike, and whose loss is
# NaN at the steps POISON_STEPS names (a batch that breaks the forward).
INJECTING_TRAIN = """
import os, sys
from pretrain.train import Task, main
from pretrain.trainer import Callback

class StepNow(Callback):
    def on_step_begin(self, trainer, step):
        self.step = step

class Inject(Task):
    def trainer(self, cfg, engine, batches, val_sets, logger, meta, callbacks):
        counter = StepNow()
        trainer = super().trainer(cfg, engine, batches, val_sets, logger, meta, [*callbacks, counter])
        if "SKIP_AT_STEP" in os.environ:
            guard, skip_at = engine.basic_optimizer.should_skip, int(os.environ["SKIP_AT_STEP"])
            # Asked once per parameter group; the guard must see every call, as without this.
            engine.basic_optimizer.should_skip = lambda: guard() | (counter.step == skip_at)
        if "POISON_STEPS" in os.environ:
            forward, poisoned = trainer.forward, {int(s) for s in os.environ["POISON_STEPS"].split(",")}
            trainer.forward = lambda batch: forward(batch) * (float("nan") if counter.step in poisoned else 1.0)
        return trainer

sys.exit(main(sys.argv[1:], Inject()))
"""


def test_a_skipped_step_of_an_expert_model_changes_no_weight_and_no_router_bias(tmp_path):
    """Through the trainer: a skipped step leaves the weights and the aux-loss-free router bias as
    the step before left them. It builds at all because DeepSpeed sorts expert parameters into
    their own groups only for optimizers it builds itself."""
    from pretrain.consolidate import full_state_dict

    data = write_synthetic_shards(tmp_path / "data")
    run, script = tmp_path / "uoe", tmp_path / "skipping_train.py"
    script.write_text(INJECTING_TRAIN)
    overrides = tiny_overrides(data, run, **{
        "train.steps": 2, "train.warmup_steps": 1, "train.skip_spikes": "true", "train.save_interval": 1,
        "model.mlp": "uoe", "model.moe.expert_hidden_size": 32, "model.moe.shared_hidden_size": 16,
        "model.moe.bias_update_rate": 0.1})
    out = torchrun(1, [str(script), *overrides], SKIP_AT_STEP="2")
    assert "AdamW (skips spikes)" in out.stdout
    (first, _, _), (second, _, _) = (full_state_dict(run / "checkpoints" / f"step_{s:08d}") for s in (1, 2))
    biases = [name for name in first if name.endswith("router_bias")]
    assert biases and all(first[name].abs().sum() > 0 for name in biases)  # step 1 moved them
    changed = [name for name in first if not torch.equal(first[name], second[name])]
    assert not changed, changed


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_accumulates_in_fp32_and_refuses_a_non_finite_gradient_by_its_norm(tmp_path, stage):
    """bf16 under ZeRO 1-2: gradients are summed and reduced in fp32 (at ZeRO-1 by DeepSpeed's
    BF16_Optimizer, at ZeRO-2 by its ZeRO optimizer, whose per-tensor overflow scan is off with
    clipping), and a step whose gradients hold a NaN is refused by the global gradient norm
    (parameters unchanged); the next clean step applies. Without clipping the scan stays on."""
    from models.gpt import GPT
    from pretrain.config import load_config
    from pretrain.engine import build_engine, deepspeed_config, invalid_global_norm
    from tests.dist_utils import single_process_group

    overrides = tiny_overrides(tmp_path, tmp_path / "run",
                               **{"train.precision": "bf16", "parallel.zero_stage": stage})
    cfg = load_config(None, overrides)
    assert deepspeed_config(cfg)["bf16"]["check_grad_overflow"] is (stage == 1)  # ZeRO-2: refused by our veto
    assert deepspeed_config(cfg)["communication_data_type"] == "fp32"
    unclipped = load_config(None, overrides + ["train.grad_clip=0"])
    assert deepspeed_config(unclipped)["bf16"]["check_grad_overflow"]
    with single_process_group():
        torch.manual_seed(0)
        engine = build_engine(cfg, GPT(cfg.model))
        if stage == 1:
            assert type(engine.optimizer).__name__ == "BF16_Optimizer" and engine.optimizer.grad_acc_dtype == torch.float32
            masters = engine.optimizer.fp32_groups_flat_partition
        else:
            assert engine.optimizer.check_grad_overflow is False
            assert engine.optimizer.gradient_accumulation_dtype == torch.float32
            masters = engine.optimizer.single_partition_of_fp32_groups
        assert engine.communication_data_type == torch.float32
        tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
        weight = engine.module.blocks[0].mlp.w_in.weight

        def step(poison: bool) -> torch.Tensor:
            """Which fp32 master weights (ZeRO's partitions, one per parameter group) the step changed."""
            hook = weight.register_hook(lambda g: g * float("nan")) if poison else None
            before = [m.detach().clone() for m in masters]
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
            if hook is not None:
                hook.remove()
            return torch.stack([(m != b).any() for m, b in zip(masters, before)])

        assert step(poison=False).all()
        assert not step(poison=True).any() and invalid_global_norm(engine.optimizer)  # refused by its norm
        assert not engine.was_step_applied() or engine.basic_optimizer.skipped  # ZeRO-1: DeepSpeed's; 2: ours
        assert step(poison=False).all()




@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_bad_batch_is_skipped_and_the_run_goes_on(tmp_path, precision):
    """With train.skip_spikes, a step whose loss is NaN changes nothing and the run trains on (without
    it, the run stops: test_non_finite_loss_stops_without_saving). In bf16 at ZeRO-1 DeepSpeed's
    BF16_Optimizer refuses the step before the guard is asked: it counts as skipped all the same."""
    from pretrain.consolidate import full_state_dict

    data = write_synthetic_shards(tmp_path / "data")
    run, script = tmp_path / "run", tmp_path / "poisoned_train.py"
    script.write_text(INJECTING_TRAIN)
    overrides = tiny_overrides(data, run, **{"train.steps": 5, "train.skip_spikes": "true", "train.save_interval": 1,
                                             "train.keep_last": 5, "train.eval_interval": 5,
                                             "train.precision": precision, "parallel.zero_stage": 1})
    out = torchrun(1, [str(script), *overrides], POISON_STEPS="3")
    assert "step 3: loss nan, update skipped: the run goes on" in out.stdout, out.stdout[-2000:]
    assert "step 3: update skipped as a spike (grad norm" in out.stdout
    [metrics] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["step"] == 5 and "train/skipped_steps" in json.loads(line)]
    assert metrics["train/skipped_steps"] == 1
    loss = {r["step"]: r["loss"] for r in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}
    assert sorted(loss) == [1, 2, 3, 4, 5] and loss[3] != loss[3] and all(loss[s] == loss[s] for s in (1, 2, 4, 5))
    before, after = (full_state_dict(run / "checkpoints" / f"step_{s:08d}")[0] for s in (2, 3))
    assert all(torch.equal(before[k], after[k]) for k in before)

