"""Matched UoE / MoE+shared / dense configs: they validate, and their parameter and FLOP counts
agree as designed (UoE = MoE minus its routers; dense = the sparse models' active compute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.counting import flops_per_token, param_counts
from models.moe.matching import matched_models, parity
from pretrain.config import ConfigError, load_config, validate
from tools.matching import PRESETS, preset_models, preset_yaml, write_configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", list(PRESETS))
def test_matched_presets_parity(name):
    models = preset_models(name)
    table = parity(models)
    uoe, moe, dense = table["uoe"], table["moe"], table["dense"]
    routers = table["uoe_minus_moe"]["routers"]
    assert routers == models["moe"].num_layers * models["moe"].moe.num_experts * models["moe"].hidden_size
    assert uoe["total"] == moe["total"] - routers
    assert uoe["active"] == moe["active"] - routers
    assert uoe["flops_per_token"] == moe["flops_per_token"] - 6 * routers
    assert dense["active"] == uoe["active"]
    assert dense["flops_per_token"] == uoe["flops_per_token"]
    assert abs(uoe["total"] - moe["total"]) / moe["total"] < 1e-3
    m = models["uoe"].moe
    assert m.routing_neurons * m.num_experts == m.shared_hidden_size  # VSE replaces the shared expert


@pytest.mark.parametrize("name", list(PRESETS))
def test_config_files_match_presets(name):
    for kind in ("uoe", "moe", "dense"):
        file = "tiny_dense.yaml" if (name, kind) == ("tiny", "dense") else \
            f"{name}_{'moe_dense' if kind == 'dense' else kind}.yaml"
        cfg = load_config(CONFIGS / file)
        wanted = preset_models(name)[kind]
        for field in ("hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "vocab_size", "mlp"):
            assert getattr(cfg.model, field) == getattr(wanted, field), (file, field)
        if kind != "dense":
            assert cfg.model.moe == wanted.moe, file
            assert cfg.parallel.expert == preset_yaml(name, kind)["parallel"]["expert"]
        world = cfg.parallel.expert * cfg.parallel.tensor
        validate(cfg, world)
        assert param_counts(cfg.model) == param_counts(wanted)
        assert flops_per_token(cfg.model) == flops_per_token(wanted)


def test_config_files_are_what_matching_writes(tmp_path):
    written = write_configs(tmp_path)
    assert len(written) == 3 * len(PRESETS) - 1
    for path in written:
        assert (CONFIGS / path.name).read_text() == path.read_text(), \
            f"configs/{path.name} is stale: python -m tools.matching --write configs"
    from tools.matching import main

    assert main(["--write", str(written[0])]) == 2  # a file, not a directory: refused, nothing written
    assert (CONFIGS / written[0].name).read_text() == written[0].read_text()


def test_fine_grained_3b():
    uoe = preset_models("3b")["uoe"]
    assert (uoe.moe.num_experts, uoe.moe.top_k, uoe.moe.routing_neurons) == (64, 8, 12)
    total = param_counts(uoe)["total"]
    assert 2.5e9 < total < 3.5e9


def test_matching_rejects_uneven_routing_neurons():
    from models.config import ModelConfig

    with pytest.raises(ValueError, match="divisible"):
        matched_models(ModelConfig(), num_experts=3, top_k=1, expert_hidden=8, shared_hidden=8)
    # Settings that would change the widths the dense twin is matched to are refused, others pass.
    with pytest.raises(ValueError, match="sets sizing itself"):
        matched_models(ModelConfig(), num_experts=4, top_k=1, expert_hidden=8, shared_hidden=8, sizing="carved")
    models = matched_models(ModelConfig(), num_experts=4, top_k=1, expert_hidden=8, shared_hidden=8, score="z")
    assert models["uoe"].moe.score == "z"
    # Routed in one layer of two: one layer's routers apart, counted off the models themselves
    base = ModelConfig(hidden_size=64, num_heads=4, num_layers=2, ffn_hidden_size=96, vocab_size=256)
    table = parity(matched_models(base, num_experts=4, top_k=1, expert_hidden=8, shared_hidden=8, moe_layers="0"))
    assert table["uoe_minus_moe"]["routers"] == 64 * 4 == table["moe"]["total"] - table["uoe"]["total"]


def test_validation_of_sparse_settings():
    cfg = load_config(CONFIGS / "tiny_uoe.yaml", ["model.moe.shared_hidden_size=0", "model.moe.routing_neurons=0"])
    with pytest.raises(ConfigError, match="routing neurons"):
        validate(cfg, 2)
    cfg = load_config(CONFIGS / "tiny_uoe.yaml", ["model.moe.score=norm"])
    with pytest.raises(ConfigError, match="score"):
        validate(cfg, 2)
    cfg = load_config(CONFIGS / "tiny_uoe.yaml", ["parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match="zero_stage=3"):
        validate(cfg, 2)
    cfg = load_config(CONFIGS / "tiny_uoe.yaml", ["parallel.tensor=2", "parallel.expert=1",
                                                   "model.moe.routing_neurons=3", "model.moe.num_experts=3"])
    with pytest.raises(ConfigError, match="virtual shared expert width"):
        validate(cfg, 2)
    for key, value, message in (("expert_hidden_size", -8, "expert_hidden_size=-8 must be >= 1"),
                                ("expert_hidden_size", 0, "expert_hidden_size=0 must be >= 1"),
                                ("shared_hidden_size", -64, "shared_hidden_size=-64 must be >= 0")):
        cfg = load_config(CONFIGS / "tiny_moe.yaml", [f"model.moe.{key}={value}", "parallel.expert=1"])
        with pytest.raises(ConfigError, match=message):
            validate(cfg, 1)


@pytest.mark.parametrize("mlp,tied", [("dense", False), ("dense", True), ("uoe", False), ("moe", False)])
def test_flops_per_token_are_the_matmuls_the_model_runs(mlp, tied):
    """flops_per_token's matmul term is 3x what a forward pass multiplies per token (the norms'
    weights multiply nothing; a head tied to the embedding multiplies as an untied one does), the
    score term Megatron's 12 x hidden x seq per layer."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.gpt import GPT
    from tests.dist_utils import single_process_group

    seq = 16
    overrides = [f"model.max_seq_len={seq}", f"model.tie_embeddings={tied}"] + ([f"model.mlp={mlp}"] if mlp != "dense" else [])
    cfg = load_config(CONFIGS / "tiny_uoe.yaml" if mlp != "dense" else None, overrides).model
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        with FlopCounterMode(display=False) as counter:
            model.logits(torch.randint(0, cfg.vocab_size, (1, seq)))
    counted = counter.get_flop_counts()["Global"]
    assert {str(op) for op in counted} == {"aten.mm"}  # SDPA's products are not among them on a CPU
    scores = 12 * cfg.hidden_size * seq * cfg.num_layers
    assert flops_per_token(cfg, seq) - scores == 3 * counter.get_total_flops() / seq


def test_a_run_of_a_config_before_its_dense_width_was_matched_still_resumes():
    """model.ffn_hidden_size sizes no weight of a model whose every layer is routed: a checkpoint of
    the sparse configs as they were (352) loads with them as they are; with a dense layer it counts."""
    from pretrain.checkpoint import CheckpointError, check_compatible

    now = load_config(CONFIGS / "125m_moe.yaml").to_dict()["model"]
    check_compatible({"model": {**now, "ffn_hidden_size": 352}}, now, None, "old")
    partial = {**now, "moe": {**now["moe"], "moe_layers": "0"}}
    with pytest.raises(CheckpointError, match="ffn_hidden_size: checkpoint 352"):
        check_compatible({"model": {**partial, "ffn_hidden_size": 352}}, partial, None, "old")


def test_a_checkpoint_matches_by_the_sections_its_layers_read():
    """model.moe fixes the routed layers only: a dense model loads with any moe section, a router MoE
    with any of UoE's keys; a UoE layer spelled two ways (N_s given or derived, carved or additive
    sizing of the same widths) is one model, and a key that changes it still counts."""
    from pretrain.checkpoint import CheckpointError, check_compatible

    uoe = load_config(CONFIGS / "125m_uoe.yaml").to_dict()["model"]
    moe = uoe["moe"]
    dense = {**uoe, "mlp": "dense"}
    check_compatible({"model": dense}, {**dense, "moe": {**moe, "num_experts": 4}}, None, "ckpt")
    router = {**uoe, "mlp": "moe"}
    check_compatible({"model": router}, {**router, "moe": {**moe, "score": "z", "vse_mode": "disjoint"}}, None, "ckpt")
    with pytest.raises(CheckpointError, match="moe.top_k: checkpoint 2 vs config 1"):
        check_compatible({"model": router}, {**router, "moe": {**moe, "top_k": 1}}, None, "ckpt")
    assert moe["routing_neurons"] * moe["num_experts"] == moe["shared_hidden_size"]
    check_compatible({"model": uoe}, {**uoe, "moe": {**moe, "routing_neurons": 0}}, None, "ckpt")
    carved = {**moe, "sizing": "carved", "expert_hidden_size": moe["expert_hidden_size"] + moe["routing_neurons"]}
    check_compatible({"model": uoe}, {**uoe, "moe": carved}, None, "ckpt")
    with pytest.raises(CheckpointError, match=r"moe.expert_hidden_size \(rest neurons by sizing\): checkpoint 512 vs "
                                              "config 448"):
        check_compatible({"model": uoe}, {**uoe, "moe": {**moe, "sizing": "carved"}}, None, "ckpt")
    with pytest.raises(CheckpointError, match="moe.score: checkpoint 'h' vs config 'z'"):
        check_compatible({"model": uoe}, {**uoe, "moe": {**moe, "score": "z"}}, None, "ckpt")
    with pytest.raises(CheckpointError, match="moe.vse_mode: checkpoint 'overlap' vs config 'disjoint'"):
        check_compatible({"model": uoe}, {**uoe, "moe": {**moe, "vse_mode": "disjoint"}}, None, "ckpt")
    # One set of routed layers however it is written (as a resume reads the saved config back).
    for spelling in ("3, 1", "1,3,3", [3, 1], " 1,3 "):
        check_compatible({"model": {**uoe, "moe": {**moe, "moe_layers": "1,3"}}},
                         {**uoe, "moe": {**moe, "moe_layers": spelling}}, None, "ckpt")
    with pytest.raises(CheckpointError, match="moe.moe_layers: checkpoint '1,3' vs config '1,2'"):
        check_compatible({"model": {**uoe, "moe": {**moe, "moe_layers": "1,3"}}},
                         {**uoe, "moe": {**moe, "moe_layers": [2, 1]}}, None, "ckpt")
    assert load_config(CONFIGS / "125m_uoe.yaml", ["model.moe.moe_layers=[3, 1]"]).model.moe.moe_layers == "1,3"
    with pytest.raises(ConfigError, match=r"model.moe.moe_layers='1,x': give 'all' or indices >= 0"):
        load_config(CONFIGS / "125m_uoe.yaml", ["model.moe.moe_layers=1,x"])
    # A router MoE refuses UoE keys no layer could take, rather than ignoring them.
    with pytest.raises(ConfigError, match="model.moe.score='hh'"):
        validate(load_config(CONFIGS / "125m_moe.yaml", ["model.moe.score=hh", "parallel.expert=1"]), 1)
