"""Planner: exact parameter counts for every shipped config, memory close to measured, and
layouts that cannot fit rejected with the reason."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.memory_plan import measurement_env
from launch.plan import main as plan_main
from launch.plan import plan
from pretrain.config import load_config, validate
from tests.dist_utils import REPO, child_env, spawn
from tests.parallel_checks import meta_param_counts

CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))


def test_every_config_validates_and_counts_match_meta_instantiation(tmp_path):
    for path in CONFIGS:
        cfg = load_config(REPO / path)
        world = cfg.parallel.tensor * cfg.parallel.expert
        validate(cfg, world)
    spawn(meta_param_counts, 1, [str(REPO / p) for p in CONFIGS], str(tmp_path / "counts.pt"))
    counts = torch.load(tmp_path / "counts.pt")
    assert len(counts) == len(CONFIGS) >= 8
    for path, (counted, instantiated) in counts.items():
        assert counted == instantiated, path


def test_layout_that_cannot_fit_is_rejected_with_reason(capsys):
    cfg = load_config(REPO / "configs/dense_3b.yaml")
    small = plan(cfg, nodes=1, gpus_per_node=1, gpu_mem_gb=16)
    assert not small["fits"] and "needs" in small["reason"] and "16 GB" in small["reason"]
    big = plan(cfg, nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    assert big["fits"] and big["largest_micro_batch"] >= cfg.train.micro_batch
    # ZeRO-3 spreads weights over data-parallel ranks: less memory per GPU than ZeRO-1.
    cfg.parallel.zero_stage = 3
    assert plan(cfg, 1, 8, 80)["memory_gb"]["weights"] < big["memory_gb"]["weights"] / 4
    assert plan_main([str(REPO / "configs/dense_3b.yaml"), "--gpus-per-node", "1", "--gpu-mem-gb", "16"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_layout_is_a_config_error(capsys):
    assert plan_main([str(REPO / "configs/dense_1b.yaml"), "parallel.tensor=3", "--gpus-per-node", "3"]) == 2
    assert "num_heads=16 is not divisible by parallel.tensor=3" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["h512-l8", "h512-l8-ckpt"])
def test_memory_estimate_within_20_percent_of_measured(size):
    env = {**child_env(), **measurement_env()}
    out = subprocess.run([sys.executable, "-m", "bench.memory_plan", "--one", size], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert 0.8 <= result["ratio"] <= 1.2, result
