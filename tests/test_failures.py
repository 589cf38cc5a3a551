"""Failure handling in real runs: a killed job restarts cleanly from its last complete
checkpoint (stale streaming shared memory included), a non-finite loss stops the run, and
activation checkpointing changes nothing numerically."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial

import psutil
import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from tests.dist_utils import REPO, child_env, free_port, single_process_group, spawn, train
from tests.parallel_checks import gpt_loss_and_grads
from tests.synthetic import tiny_overrides, write_synthetic_shards


def test_killed_run_resumes_from_last_complete_checkpoint(tmp_path):
    data = write_synthetic_shards(tmp_path / "data")
    run = tmp_path / "run"
    overrides = tiny_overrides(data, run, **{"train.steps": 40, "train.save_interval": 3})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "pretrain.train", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if metrics.is_file() and sum(1 for _ in metrics.open()) >= 8:
                break
            assert proc.poll() is None, "training exited before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("training made no progress")
    finally:
        # torchrun starts its workers in sessions of their own: kill the whole tree, with no
        # chance to clean up shared memory or finish a save.
        tree = psutil.Process(proc.pid)
        for p in [tree, *tree.children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        proc.wait()
    latest = (run / "checkpoints" / "latest").read_text()
    # The losses of every step the checkpoint keeps were written before it was.
    steps = [json.loads(line)["step"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= int(latest.removeprefix("step_")), steps
    out = train(2, overrides)
    assert f"resumed from {run / 'checkpoints' / latest}" in out.stdout
    assert (run / "checkpoints" / "step_00000040" / "COMPLETE").is_file()
    # Each step logged once: the records after the checkpoint (trained again) were set aside.
    steps = [json.loads(line)["step"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41)), steps
    logged = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in r]
    assert logged == sorted(set(logged)) and logged[-1] == 40, logged


def test_non_finite_loss_stops_without_saving(tmp_path):
    data = write_synthetic_shards(tmp_path / "data")
    run = tmp_path / "run"
    # A finite std in the config (inf is refused there) that float32 weights hold as inf.
    out = train(1, tiny_overrides(data, run, **{"model.init_std": "1e300"}), check=False)
    assert out.returncode != 0
    assert "loss became nan at step 1" in out.stderr and "train.skip_spikes=true" in out.stderr
    assert not (run / "checkpoints" / "latest").exists()
    from launch.status import format_status, status  # the run directory says what ended it

    assert "failed:      " in (shown := format_status(status(run))) and \
        "on rank 0: NonFiniteLossError: loss became nan at step 1" in shown, shown
    # Skipping non-finite steps goes on past a bad batch, not past a model that is broken for good.
    out = train(1, tiny_overrides(data, run, **{"model.init_std": "1e300", "train.skip_spikes": "true",
                                                "train.steps": 20}), check=False)
    assert out.returncode != 0 and "loss became nan at step 10, 10 step(s) in a row" in out.stderr
    assert "step 9: loss nan, update skipped: the run goes on" in out.stdout
    assert not (run / "checkpoints" / "step_00000010").exists()
    assert "loss became nan at step 10" in json.loads((run / "FAILED").read_text())["error"]  # this start's


# pretrain.train whose second optimizer step in this process gets a NaN gradient (the loss stays finite).
NAN_GRADIENT_TRAIN = """
import sys
from pretrain import trainer
from pretrain.train import main

calls, train_step = [0], trainer.Trainer.train_step

def poisoned(self, *args, **kwargs):
    calls[0] += 1
    hook = self.model.norm.weight.register_hook(lambda g: g * float("nan")) if calls[0] == 2 else None
    try:
        return train_step(self, *args, **kwargs)
    finally:
        if hook is not None:
            hook.remove()

trainer.Trainer.train_step = poisoned
sys.exit(main(sys.argv[1:]))
"""


def test_a_resume_follows_the_config_and_a_skipped_update_keeps_the_schedule(tmp_path):
    """A wsd run saved in its decay (step 5 of 6) resumes with 10 steps, another weight decay, beta2
    and global batch: notes say the rate rises again and the batch changed, the optimizer takes the new settings, and step 7, whose
    gradients are not finite, is skipped with the schedule moving on (every logged rate is the
    schedule's at its step)."""
    from pretrain.config import TrainConfig
    from pretrain.schedule import lr_multiplier
    from tests.dist_utils import torchrun

    data, run, script = write_synthetic_shards(tmp_path / "data"), tmp_path / "run", tmp_path / "nan_train.py"
    script.write_text(NAN_GRADIENT_TRAIN)
    common = {"train.schedule": "wsd", "train.decay_fraction": 0.5, "train.warmup_steps": 1, "train.eval_batches": 0}
    train(1, tiny_overrides(data, run, **common, **{"train.steps": 6, "train.stop_at_step": 5}))
    resumed = {**common, "train.steps": 10, "train.weight_decay": 0.5, "train.beta2": 0.99, "train.grad_accum": 2,
               "data.shuffle_seed": 999, "train.init_from": tmp_path / "elsewhere"}
    out = torchrun(1, [str(script), *tiny_overrides(data, run, **resumed)])
    # Keys a resume does not take are named: the sample order is the checkpoint's, init_from a new run's.
    assert ("note: data.shuffle_seed=999 (the run's is 1234): the resumed run goes on in the sample order of its "
            "checkpoint") in out.stdout
    assert f"note: train.init_from={tmp_path / 'elsewhere'} is not read" in out.stdout
    assert ("note: step 6 trains at lr 0.00246, where the checkpoint's schedule (train.steps=6, wsd) was at "
            "0.0003") in out.stdout
    # train.micro_batch=4 on one process: twice the samples per step from here
    assert "note: the checkpoint trained with a global batch of 4 samples; from step 6 each step takes 8" in out.stdout
    assert "step 7: the gradients were not finite; update skipped (1 so far in this process)" in out.stdout
    schedule = TrainConfig(steps=10, warmup_steps=1, schedule="wsd", decay_fraction=0.5, lr=3e-3)
    logged = {r["step"]: r["train/lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "train/lr" in r and r["step"] > 5}
    assert logged == pytest.approx({s: 3e-3 * lr_multiplier(s - 1, schedule) for s in range(6, 11)}, rel=1e-6)
    optim = run / "checkpoints" / "step_00000010" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    groups = torch.load(optim, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [(g["name"], g["weight_decay"], tuple(g["betas"])) for g in groups] == [
        ("decay", 0.5, (0.9, 0.99)), ("no_decay", 0.0, (0.9, 0.99))]


def test_activation_checkpointing_gives_same_loss_and_grads(tmp_path):
    """Full checkpointing recomputes every block in backward, LISA layers (a chain of two) with the
    scores their previous layer handed over in the forward."""
    kwargs = dict(vocab_size=300, hidden_size=64, num_heads=4, num_layers=3, ffn_hidden_size=96, max_seq_len=32,
                  attention="sll")
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "plain.pt"))
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "ckpt.pt"), 0, True)
    plain, ckpt = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "ckpt.pt")
    assert (plain["block_forwards"], ckpt["block_forwards"]) == (3, 6)  # it did recompute
    assert torch.equal(plain["loss"], ckpt["loss"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(ckpt["grads"][name], grad, rtol=0, atol=0, msg=name)


def test_compiled_blocks_give_same_loss_and_grads(tmp_path):
    """train.compile: torch.compile'd blocks (hybrid attention, UoE) compute what eager blocks do."""
    from models.moe.routing import MoEConfig

    kwargs = dict(vocab_size=300, hidden_size=64, num_heads=4, num_layers=2, ffn_hidden_size=96, max_seq_len=32,
                  attention="sr", mlp="uoe",
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_size=32, shared_hidden_size=32))
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "eager.pt"))
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "compiled.pt"), 0, False, True)
    eager, compiled = torch.load(tmp_path / "eager.pt"), torch.load(tmp_path / "compiled.pt")
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
    assert compiled["compiled"] and not eager["compiled"]
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("keep_chain_scores", [False, True])
def test_compiled_hybrid_blocks_make_a_graph_per_kind_of_layer_not_per_layer(keep_chain_scores):
    """Compiled blocks share one code object: ten blocks of three LISA chains make four graphs
    (softmax that publishes / does not, LISA after softmax, LISA after LISA: lazy or kept scores),
    not one per block (where dynamo's recompile limit would leave the later blocks eager), and
    compute what eager blocks do."""
    from torch._dynamo.utils import counters

    from models.config import ModelConfig
    from models.gpt import GPT

    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_heads=4, num_layers=10, ffn_hidden_size=64, max_seq_len=16,
                      attention="sllsllslls")
    cfg.lisa.keep_chain_scores = keep_chain_scores
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    results = []
    with single_process_group():
        for compiled in (False, True):
            torch.manual_seed(0)
            model = GPT(cfg)
            torch._dynamo.reset()
            counters.clear()
            if compiled:
                model.compile_blocks(backend="eager")  # dynamo's guards and graphs, without codegen
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert counters["stats"]["unique_graphs"] == 4
    (eager, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-7)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_units_break_only_where_they_must():
    """Each block train.compile compiles traces whole, except where it must not: a dense block of
    every attention kind is one graph; a routed (UoE / MoE) block leaves only its routing
    statistics to run eagerly, and its expert dispatch where that waits for the device (here on a
    CPU, where the experts run one by one): a stray graph break would split a block and cost the
    fusion."""
    from models.config import ModelConfig
    from models.gpt import GPT
    from models.moe.routing import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_size=32, shared_hidden_size=32)
    eager_parts = {"dense": set(), "uoe": {"_record_routing", "record", "dispatch_combine"},
                   "moe": {"_record_routing", "record", "dispatch_combine"}}
    with single_process_group():
        for mlp, allowed in eager_parts.items():
            cfg = ModelConfig(vocab_size=300, hidden_size=64, num_heads=4, num_layers=4, ffn_hidden_size=96,
                              max_seq_len=32, attention="skrl", mlp=mlp, moe=moe)
            model = GPT(cfg)
            ctx = {"rotary": model.rotary, "recompute_attention": False}
            x = torch.randn(2, 32, 64)
            for layer, block in enumerate(model.compile_targets()):
                torch._dynamo.reset()
                # what GPT.hidden_states hands a block: the scores the previous layer published
                ctx["shared_scores"], ctx["published_scores"] = ctx.get("published_scores"), None
                explained = torch._dynamo.explain(block)(x, ctx, ctx["shared_scores"])
                reasons = [str(r.reason) for r in explained.break_reasons]
                assert all("torch.compiler.disable" in r for r in reasons), (mlp, layer, reasons)
                skipped = {disabled_function(r) for r in reasons}
                expected = not reasons if mlp == "dense" else "_record_routing" in skipped
                assert skipped <= allowed and expected, (mlp, layer, skipped, [r[:300] for r in reasons])
                assert (explained.graph_count == 1) == (mlp == "dense"), (mlp, layer, explained.graph_count)


def disabled_function(reason: str) -> str:
    """The name of the torch.compiler.disable'd function a graph-break reason names."""
    match = re.search(r"function <?(?:function )?([\w.]+)", reason.split("Explanation:")[-1])
    return match.group(1).rsplit(".", 1)[-1] if match else ""


def test_compiled_routed_block_traces_a_dropless_grouped_dispatch():
    """bf16, dropless, every expert local, grouped GEMMs: the dispatch never waits for the device,
    so torch.compile traces it with the rest of the block (fullgraph alone proves it), and the
    compiled block (inductor) computes what the eager one does, counting its routing once."""
    from models.config import ModelConfig
    from models.gpt import GPT
    from models.moe.dispatch import dispatch_combine
    from models.moe.experts import grouped_swiglu
    from models.moe.routing import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_size=32, shared_hidden_size=32, grouped_gemm="true")
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_heads=4, num_layers=1, ffn_hidden_size=96,
                      max_seq_len=32, attention="s", mlp="uoe", moe=moe)
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(cfg)
        block = model.blocks[0].to(torch.bfloat16)
        experts = block.mlp.experts.deepspeed_moe.experts.deepspeed_experts
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(48, 64, generator=gen).bfloat16()
        ids = torch.randint(0, 4, (48, 2), generator=gen)
        w = torch.rand(48, 2, generator=gen)
        args = (x, ids, w, experts, 4, None, partial(grouped_swiglu, experts))
        for may_drop in (False, True):
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(dispatch_combine, fullgraph=not may_drop, backend="eager")
            torch.testing.assert_close(compiled(*args, may_drop), dispatch_combine(*args, may_drop))
            assert (counters["stats"]["unique_graphs"] > 1) == may_drop  # looking for dropped ones syncs

        hidden = torch.randn(2, 32, 64, generator=gen).bfloat16()
        results, sums = [], []
        # eager, compiled, compiled and recomputed in backward (full activation checkpointing)
        for compile_it, recompute in ((False, False), (True, False), (True, True)):
            if not recompute:
                torch._dynamo.reset()
                counters.clear()
            block.mlp.stats.reset()
            block.zero_grad()
            if compile_it and not recompute:
                block.compile()
            xi = hidden.clone().requires_grad_()
            ctx = {"rotary": model.rotary, "recompute_attention": False}
            y = checkpoint(block, xi, ctx, None, use_reentrant=False) if recompute else block(xi, ctx, None)
            (y.float() * torch.linspace(-1, 1, 64)).sum().backward()
            stats = block.mlp.stats
            tokens = stats.totals()["tokens"]
            assert (tokens, stats.forwards, int(stats.as_tensor()[:4].sum())) == (64, 1, 128)
            sums.append(stats.as_tensor())  # loads, score sums, aux loss, output norms
            results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in block.named_parameters()}))
            if compile_it and not recompute:
                breaks = [disabled_function(str(reason)) for reason in counters["graph_break"]]
                assert counters["stats"]["unique_graphs"] > 0 and "dispatch_combine" not in breaks, breaks
    (y0, g0, p0), (y1, g1, p1), (y2, g2, p2) = results
    assert sums[0][-5:-3].min() > 0  # the output norms were measured
    torch.testing.assert_close(sums[1], sums[0], rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(sums[2], sums[1], rtol=0, atol=0)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    torch.testing.assert_close(g2, g1, rtol=0, atol=0)
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g1, g0, rtol=2e-2, atol=2e-2)
    for name, grad in p0.items():
        scale = float(grad.float().abs().max()) + 1e-6
        torch.testing.assert_close(p1[name].float() / scale, grad.float() / scale, rtol=0, atol=3e-2,
                                   msg=name)


TOOL_STOPPED_MID_WRITE = """
import os, signal, sys, time
from pathlib import Path
from pretrain.checkpoint import directory_in_place
from tools.cli import run

def main():
    with directory_in_place(Path(sys.argv[1])) as tmp:
        (tmp / "half").write_text("written")
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # as timeout, kill or scancel sends SIGTERM
        time.sleep(3)
    return 0

run(main)
"""


def test_a_tool_stopped_by_sigterm_leaves_no_partial_output(tmp_path):
    """A tool stopped by SIGTERM while writing removes what it wrote, as on Ctrl-C (a hidden
    temporary folder of a 3B export was left behind)."""
    script = tmp_path / "tool.py"
    script.write_text(TOOL_STOPPED_MID_WRITE)
    out = tmp_path / "out" / "export"
    proc = subprocess.run([sys.executable, str(script), str(out), "SIGTERM"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143 and "stopped by SIGTERM" in proc.stderr, proc.stderr[-2000:]
    assert list((tmp_path / "out").iterdir()) == []
    # Started under nohup (SIGHUP ignored), a closed terminal does not stop it.
    proc = subprocess.run([sys.executable, str(script), str(out), "SIGHUP"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert proc.returncode == 0 and (out / "half").read_text() == "written", proc.stderr[-2000:]


def test_a_second_run_into_a_busy_run_dir_is_refused(tmp_path):
    """Two jobs into one run.dir would write over each other's checkpoints and losses: while one
    holds it, another is refused, naming the holder, before it writes anything there; the lock
    goes with the holding process, however it ends."""
    from pretrain import run_lock

    data = write_synthetic_shards(tmp_path / "data")
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pretrain import run_lock; run_lock.hold(Path(sys.argv[1])); print('held', "
                               "flush=True); time.sleep(600)", str(run)], cwd=REPO, env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        out = train(1, tiny_overrides(data, run, **{"train.steps": 3}), check=False)
        assert out.returncode != 0, out.stderr[-2000:]
        assert f"run.dir={run} is in use by another run (host " in out.stderr
        assert f"pid {holder.pid}" in out.stderr and not (run / "config.yaml").exists()
        assert run_lock.hold(run) is not None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run_lock.hold(run) is None  # a killed holder leaves no lock behind
    run_lock.release()
    train(1, tiny_overrides(data, run, **{"train.steps": 3}))
    assert (run / "config.yaml").exists()


def test_a_save_that_runs_out_of_room_names_the_intact_checkpoint(tmp_path):
    """A save that cannot write (a full disk; here a file-size limit) stops the run with an error that
    names the save, the room left and the newest complete checkpoint, which stays the one a resume
    takes."""
    from pretrain.checkpoint_format import latest_complete

    data, run = write_synthetic_shards(tmp_path / "data"), tmp_path / "run"
    overrides = tiny_overrides(data, run, **{"train.steps": 6, "train.save_interval": 3, "train.eval_batches": 0})
    train(1, [*overrides, "train.stop_at_step=3"])
    biggest = max(f.stat().st_size for f in (run / "checkpoints" / "step_00000003").iterdir())
    limit = f"ulimit -f {biggest // 1024 - 1}"  # in KiB: under the largest checkpoint file
    out = subprocess.run(["bash", "-c", f'{limit} && exec "$0" -m pretrain.train "$@"', sys.executable, *overrides],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    error = next(line for line in out.stderr.splitlines() if line.startswith("error: "))
    assert f"error: saving checkpoint {run / 'checkpoints' / 'step_00000006'} failed (" in error
    assert "GB are free on its file system; the last one took" in error
    assert (f"The newest complete checkpoint, {run / 'checkpoints' / 'step_00000003'}, is intact (the unfinished "
            "step_00000006 is never resumed)") in error
    assert latest_complete(run / "checkpoints") == run / "checkpoints" / "step_00000003"


def test_only_a_refused_write_is_reported_as_a_storage_problem(tmp_path):
    """A save's errors: a full disk or a quota advise freeing space, another refused write (no
    permission) a writable directory; a peer lost in the save's collectives is not a storage error."""
    import errno

    from pretrain.checkpoint import save_failure, storage_error

    full = OSError(errno.ENOSPC, "No space left on device")
    denied = PermissionError(errno.EACCES, "Permission denied")
    torch_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 924416 vs 924304")
    assert storage_error(full) and storage_error(denied) and storage_error(torch_write)
    assert not storage_error(torch.distributed.DistBackendError("Connection closed by peer"))
    assert not storage_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not storage_error(RuntimeError("Expected all tensors to be on the same device"))
    assert "free space there, or lower train.keep_last" in save_failure(tmp_path, "step_00000006", full)
    assert "free space there" in save_failure(tmp_path, "step_00000006", torch_write)
    assert "make the checkpoint directory writable" in save_failure(tmp_path, "step_00000006", denied)


def test_a_lock_whose_slurm_job_runs_no_more_is_passed_over(tmp_path, monkeypatch):
    """A lock a lost node's file-system client keeps (NFSv3) must not stop the requeue of its own job,
    nor a new job once Slurm says the holder's job ended; a holder whose job runs refuses."""
    from pretrain import run_lock

    squeue = tmp_path / "bin" / "squeue"
    squeue.parent.mkdir()
    monkeypatch.setenv("PATH", f"{squeue.parent}:{os.environ['PATH']}")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pretrain import run_lock; run_lock.hold(Path(sys.argv[1])); print('held', "
                               "flush=True); time.sleep(600)", str(tmp_path)], cwd=REPO,
                              env=child_env(SLURM_JOB_ID="77"), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.setenv("SLURM_JOB_ID", "77")  # a requeue of the holder's job
        assert run_lock.hold(tmp_path) is None
        monkeypatch.setenv("SLURM_JOB_ID", "78")
        squeue.write_text("#!/bin/sh\necho RUNNING\n")
        squeue.chmod(0o755)
        assert "is in use by another run (host " in run_lock.hold(tmp_path)
        squeue.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
        assert run_lock.hold(tmp_path) is None  # job 77 ended long ago
    finally:
        holder.kill()
        holder.wait()
        run_lock.release()
