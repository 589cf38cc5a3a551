"""Failure handling in real runs: a killed job restarts cleanly from its last complete
checkpoint (stale streaming shared memory included), a non-finite loss stops the run, and
activation checkpointing changes nothing numerically."""

import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

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
    out = train(2, overrides)
    assert f"resumed from {run / 'checkpoints' / latest}" in out.stdout
    assert (run / "checkpoints" / "step_00000040" / "COMPLETE").is_file()


def test_non_finite_loss_stops_without_saving(tmp_path):
    data = write_synthetic_shards(tmp_path / "data")
    run = tmp_path / "run"
    out = train(1, tiny_overrides(data, run, **{"model.init_std": "inf"}), check=False)
    assert out.returncode != 0
    assert "loss became nan at step 1" in out.stderr
    assert not (run / "checkpoints" / "latest").exists()


def test_activation_checkpointing_gives_same_loss_and_grads(tmp_path):
    """Full checkpointing recomputes every block in backward, LISA layers (a chain of two) with the
    scores their previous layer handed over in the forward."""
    kwargs = dict(vocab_size=300, hidden_size=64, num_heads=4, num_layers=3, ffn_hidden_size=96, max_seq_len=32,
                  attention="sll")
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "plain.pt"))
    spawn(gpt_loss_and_grads, 1, kwargs, str(tmp_path / "ckpt.pt"), 0, True)
    plain, ckpt = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "ckpt.pt")
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


def test_compiled_units_trace_as_one_graph_each():
    """Each unit train.compile compiles (dense blocks of every attention kind, the attention of
    UoE/MoE blocks) is one graph: a graph break would split it and cost the fusion."""
    from models.config import ModelConfig
    from models.gpt import GPT, Block
    from models.moe.routing import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden_size=32, shared_hidden_size=32)
    with single_process_group():
        for mlp in ("dense", "uoe", "moe"):
            cfg = ModelConfig(vocab_size=300, hidden_size=64, num_heads=4, num_layers=4, ffn_hidden_size=96,
                              max_seq_len=32, attention="skrl", mlp=mlp, moe=moe)
            model = GPT(cfg)
            ctx = {"rotary": model.rotary, "recompute_attention": False}
            x = torch.randn(2, 32, 64)
            for layer, unit in enumerate(model.compile_targets()):
                torch._dynamo.reset()
                # what GPT.hidden_states hands a block (and a block its attention): the scores
                # the previous layer published
                ctx["shared_scores"], ctx["published_scores"] = ctx.get("published_scores"), None
                args = (x, ctx, ctx["shared_scores"]) if isinstance(unit, Block) else (x, ctx)
                explained = torch._dynamo.explain(unit)(*args)
                assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
                    (mlp, layer, type(unit).__name__, [str(r.reason)[:300] for r in explained.break_reasons])
