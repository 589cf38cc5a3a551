"""Whole training runs of a tiny UoE model through DeepSpeed at expert-parallel size 2 (gloo, 2
processes): an EP=2 checkpoint resumes at EP=2 onto the uninterrupted loss curve, and loads at
EP=1 with the same loss and gradient norm on the next batch; routing telemetry reaches the logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state as ps

from tests.dist_utils import spawn, train
from tests.synthetic import tiny_overrides, write_synthetic_shards

UOE = ["model.mlp=uoe", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden_size=32",
       "model.moe.shared_hidden_size=32", "model.moe.bias_update_rate=0.01"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "losses.jsonl")}


def train_metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_synthetic_shards(tmp_path_factory.mktemp("uoe_shards"))


@pytest.fixture(scope="module")
def ep2_run(shards, tmp_path_factory) -> Path:
    full = tmp_path_factory.mktemp("uoe_ep2") / "full"
    train(2, tiny_overrides(shards, full, **{"parallel.expert": 2, "parallel.zero_stage": 2}) + UOE)
    return full


def test_uoe_ep2_resume_and_ep_change(shards, ep2_run, tmp_path):
    full = ep2_run
    reference = losses(full)
    assert sorted(reference) == list(range(1, 9))
    assert reference[8] < reference[1]
    step4 = full / "checkpoints" / "step_00000004"
    assert (step4 / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()
    assert json.loads((step4 / "COMPLETE").read_text())["expert_parallel"] == 2

    # Routing telemetry on log steps (log_interval=1).
    last = read_jsonl(full / "metrics.jsonl")
    routing = {k: v for r in last for k, v in r.items() if k.startswith("routing/")}
    for key in ("routing/layer0/load_entropy", "routing/layer1/max_load", "routing/layer0/load_e3",
                "routing/layer0/dropped_tokens", "routing/layer0/score_e0", "routing/layer0/aux_loss",
                "routing/layer1/vse_over_routed", "routing/load_entropy"):
        assert key in routing, key
    assert 0.0 < routing["routing/load_entropy"] <= 1.0
    assert list((full / "tensorboard").iterdir())

    # Resume the step-4 checkpoint at EP=2: the same curve as the uninterrupted run.
    resumed = tmp_path / "resumed"
    out = train(2, tiny_overrides(shards, resumed, **{"parallel.expert": 2, "parallel.zero_stage": 2,
                                                      "train.resume": step4}) + UOE)
    assert "moments start afresh" not in out.stdout
    got = losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(reference[step], abs=1e-5), (step, got, reference)

    # Load the EP=2 checkpoint of 2 ranks at EP=1 on one process (ZeRO-1; the global batch kept by
    # grad_accum: a job after losing a node): the next batch gives the same loss, and the same
    # global gradient norm, which checks DeepSpeed's expert-gradient scaling at both EP sizes.
    ep1 = tmp_path / "ep1"
    out = train(1, tiny_overrides(shards, ep1, **{"parallel.expert": 1, "parallel.zero_stage": 1, "train.grad_accum": 2,
                                                  "train.resume": step4, "train.stop_at_step": 5}) + UOE)
    assert ("saved at world 2, expert-parallel size 2, this run is at world 1, 1: AdamW's moments start afresh"
            in out.stdout)
    assert losses(ep1)[5] == pytest.approx(reference[5], abs=1e-5)
    norm_ep1 = train_metrics(ep1)[5]["train/grad_norm"]
    norm_ep2 = train_metrics(full)[5]["train/grad_norm"]
    # Not to float rounding: the load-balancing loss is per micro-batch and rank, and rank r of 2 reads
    # samples r, r+2, ... where grad_accum's micro-batches hold 0-3 and 4-7 (the same samples in all)
    assert norm_ep1 == pytest.approx(norm_ep2, rel=1e-4)


def _consolidated_loss_at_ep2_and_ep1(rank: int, tag_dir: str, config_path: str) -> None:
    from models.gpt import GPT
    from pretrain.checkpoint_format import EXPERT_KEY
    from pretrain.config import load_config
    from tools.convert_experts import expert_major_state, load_full_state_dict

    cfg = load_config(config_path)
    full = expert_major_state(tag_dir)
    experts = [EXPERT_KEY.match(k) for k in full if EXPERT_KEY.match(k)]
    ids = sorted({(m.group(1), int(m.group(2))) for m in experts})
    assert len(ids) == cfg.model.num_layers * cfg.model.moe.num_experts
    tokens = torch.randint(4, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = {}
    for ep in (2, 1):
        if ep == 1:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
        cfg.parallel.expert = ep
        model = GPT(cfg.model).eval()
        load_full_state_dict(model, full)
        assert model.blocks[0].mlp.experts.num_local_experts == cfg.model.moe.num_experts // ep
        with torch.no_grad():
            losses[ep] = float(model(tokens[:, :-1], tokens[:, 1:]))
    assert abs(losses[2] - losses[1]) < 1e-5, losses


def test_convert_ep2_checkpoint_to_plain_state_dict_loads_at_any_ep(ep2_run, tmp_path, capsys):
    """The EP=2 checkpoint, consolidated into one expert-major state dict, gives the same loss on a
    fixed batch in a model built at EP=2 and at EP=1."""
    from tools.convert_experts import expert_major_state, main

    tag = ep2_run / "checkpoints" / "step_00000004"
    spawn(_consolidated_loss_at_ep2_and_ep1, 2, str(tag), str(ep2_run / "config.yaml"), expert=2)
    assert main(["--checkpoint", str(tag), "--out", str(tmp_path / "experts.pt"), "--mp-rank", "1"]) == 2
    assert (f"--mp-rank 1: {tag} was saved at tensor-parallel size 1; give a rank from 0 to 0"
            in capsys.readouterr().err)
    out = tmp_path / "new" / "folder" / "experts.pt"  # its folders made, as consolidate makes them
    assert main(["--checkpoint", str(ep2_run), "--out", str(out)]) == 0
    assert sorted(torch.load(out, weights_only=True)) == sorted(expert_major_state(tag))


def test_convert_experts_never_replaces_a_file_unasked(tmp_path, capsys):
    from tools.convert_experts import main

    out = tmp_path / "experts.pt"
    out.write_bytes(b"an earlier conversion")
    assert main(["--checkpoint", str(tmp_path / "no_such_run"), "--out", str(out)]) == 2
    assert f"--out {out} exists; choose a new file or pass --overwrite" in capsys.readouterr().err
    for older in ([str(tmp_path / "no_such_run"), str(out)], [str(tmp_path / "no_such_run"), "--mp-rank", "0", str(out)]):
        assert main(older) == 2  # CHECKPOINT OUT, as earlier versions took them
        assert f"--out {out} exists" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier conversion"


def test_readers_of_a_bf16_expert_model_get_its_experts_fp32_masters(shards, tmp_path):
    """At expert-parallel size 2 over two ranks, each rank's optimizer partition holds the fp32
    masters of its own experts under local ids (0, 1): read back under global ids (0-3), every
    master rounds to the bf16 weight of its expert file (experts swapped would not)."""
    import torch

    from pretrain.checkpoint_format import EXPERT_KEY
    from pretrain.consolidate import full_state_dict

    run = tmp_path / "run"
    train(2, tiny_overrides(shards, run, **{"parallel.expert": 2, "parallel.zero_stage": 2, "train.precision": "bf16",
                                            "train.steps": 4, "train.save_interval": 4}) + UOE)
    tag = run / "checkpoints" / "step_00000004"
    state, _, meta = full_state_dict(tag)
    saved = {}
    for f in tag.glob("layer_*_expert_*_mp_rank_00_model_states.pt"):
        saved.update(torch.load(f, weights_only=False))
    experts = {k: v for k, v in state.items() if EXPERT_KEY.match(k)}
    assert meta["layout"]["local_experts"] == 2 and sorted(experts) == sorted(saved) and len(saved) == 16
    assert all(saved[k].dtype == torch.bfloat16 and v.dtype == torch.float32 for k, v in experts.items())
    assert all(torch.equal(v.to(torch.bfloat16), saved[k]) for k, v in experts.items())
    assert any(not torch.equal(v, saved[k].float()) for k, v in experts.items())  # finer than the bf16 copies
