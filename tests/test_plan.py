"""Planner: exact parameter counts for every shipped config, memory close to measured, layouts
that cannot fit rejected with the reason, and the layouts size configs state in their header fit."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.memory_plan import measurement_env
from launch.layouts import NODES_PREFIX, SINGLE_GPU_PREFIX, read_layouts
from launch.plan import main as plan_main
from launch.plan import plan
from models.counting import flops_per_token, param_counts
from pretrain.config import load_config, validate
from tests.dist_utils import REPO, child_env, spawn
from tests.parallel_checks import meta_param_counts

SINGLE_GPU_SHARE = 0.7  # a size config's single-GPU layout stays under this share of 80 GB (README)
CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))
# Size configs (all but the CPU ones) state their parameters and two layouts in their header:
#   # 8x80GB nodes: N parallel.tensor=... train.micro_batch=...   (the values the file sets)
#   # single-gpu (80-141 GB): parallel.tensor=1 parallel.expert=1 ...   (overrides for one GPU)
SIZE_CONFIGS = [p for p in CONFIGS if not Path(p).name.startswith(("tiny_", "demo"))]
PARAMS_LINE = re.compile(r"([\d.]+)M parameters(?:, ([\d.]+)M active)?")
GFLOP_LINE = re.compile(r"([\d.]+) GFLOP/token")


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
    # A peak above 95% of the GPU's memory does not fit: the reason and the table name that budget.
    peak = big["memory_total_gb"]
    tight = plan(load_config(REPO / "configs/dense_3b.yaml"), 1, 8, peak / 0.97)
    assert not tight["fits"] and tight["usable_gb"] == pytest.approx(peak / 0.97 * 0.95)
    assert f"{tight['usable_gb']:.1f} GB are usable ({peak / 0.97:g} GB less 5% for" in tight["reason"]
    assert plan(load_config(REPO / "configs/dense_3b.yaml"), 1, 8, peak / 0.94)["fits"]


def test_single_gpu_plan_uses_the_header_layout(capsys):
    config = str(REPO / "configs/1b_uoe.yaml")
    assert plan_main([config, "--single-gpu", "--gpu-mem-gb", "141", "--gpu", "h200", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    single = load_config(config, read_layouts(config).single_gpu)
    assert result["fits"] and result["layout"]["world"] == 1
    assert result["layout"]["micro_batch"] == single.train.micro_batch != load_config(config).train.micro_batch
    assert plan_main([config, "--single-gpu", "train.micro_batch=512", "--json"]) == 1  # the caller's override wins
    capsys.readouterr()
    assert plan_main([str(REPO / "configs/tiny_dense.yaml"), "--single-gpu"]) == 2
    assert "single-gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one GPU is what --single-gpu plans: a node count is a contradiction
        plan_main([config, "--single-gpu", "--nodes", "4"])
    assert "--single-gpu plans one GPU; drop --nodes / --gpus-per-node" in capsys.readouterr().err
    assert plan_main([config, "--gpus-per-node", "1"]) == 2  # the expert-parallel layout needs 8
    assert "(on one GPU, --single-gpu applies the config header's layout)" in capsys.readouterr().err


def test_one_gpu_hint_offers_the_header_layout_for_layout_errors_on_one_process(tmp_path):
    """Only the leading comment block is the header; the hint is for a layout error on one process."""
    from launch.layouts import one_gpu_hint
    from pretrain.config import ConfigError, LayoutError

    config = REPO / "configs/1b_uoe.yaml"
    single = read_layouts(config).single_gpu
    err = LayoutError("parallel.expert=8 ...")
    assert one_gpu_hint(err, config, 1) == " (on one GPU, --single-gpu applies the config header's layout)"
    assert one_gpu_hint(err, config, 1, flag=None) == f" (on one GPU, the config header's layout: {' '.join(single)})"
    assert one_gpu_hint(err, config, 2) == "" and one_gpu_hint(ConfigError("other"), config, 1) == ""
    body_comment = tmp_path / "mine.yaml"
    body_comment.write_text(f"# my config\nmodel:\n  hidden_size: 64\n{SINGLE_GPU_PREFIX}parallel.tensor=1\n")
    assert read_layouts(body_comment).single_gpu is None and one_gpu_hint(err, body_comment, 1) == ""


def test_grouped_gemm_experts_count_a_layer_of_stacked_weights_on_hopper():
    """model.moe.grouped_gemm=auto stacks a layer's local experts' bf16 weights for each grouped GEMM
    on an H100 / H200 (forward and backward; none are kept), not on an A100; true on any GPU."""
    from models.counting import expert_params

    def activations(gpu: str, *overrides: str) -> float:
        cfg = load_config(REPO / "configs/1b_uoe.yaml", ["parallel.expert=2", *overrides])
        return plan(cfg, 1, 8, 80, gpu)["memory_gb"]["activations"] * 2**30

    cfg = load_config(REPO / "configs/1b_uoe.yaml")
    assert cfg.model.moe.grouped_gemm == "auto"
    # half the experts on each of 2 expert-parallel ranks, one of the (all routed) layers, bf16
    stacks = expert_params(cfg.model) / 2 / cfg.model.num_layers * 2
    assert activations("h100") - activations("a100") == pytest.approx(stacks, rel=1e-9)
    assert activations("h200", "model.moe.grouped_gemm=false") == activations("a100")
    assert (activations("a100", "model.moe.grouped_gemm=true") - activations("a100")
            == pytest.approx(stacks, rel=1e-9))


def test_bad_layout_is_a_config_error(capsys):
    assert plan_main([str(REPO / "configs/dense_1b.yaml"), "parallel.tensor=3", "--gpus-per-node", "3"]) == 2
    assert "num_heads=16 is not divisible by parallel.tensor=3" in capsys.readouterr().err


def test_a_measured_process_never_joins_the_measuring_one_s_process_group(monkeypatch):
    """A process that ran a tool in-process holds rank and rendezvous variables: the measured child
    starts a group of its own on a free port."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "43689")
    env = measurement_env()
    assert "RANK" not in env and "MASTER_PORT" not in env and env["MALLOC_MMAP_THRESHOLD_"] == "65536"


@pytest.mark.parametrize("size", ["h512-l8", "h512-l8-gqa", "h512-l8-ckpt", "h512-l8-sel", "h512-l8-uoe"])
def test_memory_estimate_within_20_percent_of_measured(size):
    env = {**child_env(), **measurement_env()}
    # two steps: the second is the first with optimizer states, where the peak is reached
    out = subprocess.run([sys.executable, "-m", "bench.memory_plan", "--one", size, "--steps", "2"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert 0.8 <= result["ratio"] <= 1.2, result


def layout_problems(path: Path) -> list[str]:
    """What is wrong with a size config's header: missing or wrong parameter counts, an 8x80 GB layout
    that is not what the file sets or does not fit, a single-GPU layout that does not fit in 80 GB or
    changes the global batch."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    layouts = read_layouts(path)
    params = next((m for m in map(PARAMS_LINE.search, header) if m), None)
    if not (layouts.multi_node and layouts.single_gpu and params):
        return [f"{path.name}: the header needs '<total>M parameters[, <active>M active]', "
                "'# 8x80GB nodes: N <overrides>' and '# single-gpu (80-141 GB): <overrides>' lines"]
    problems = []
    written = load_config(path)
    counts = param_counts(written.model)
    if abs(float(params[1]) - counts["total"] / 1e6) > 0.05:
        problems.append(f"{path.name}: states {params[1]}M parameters, counts {counts['total'] / 1e6:.1f}M")
    active = float(params[2] or "nan")
    if written.model.mlp != "dense" and not abs(active - counts["active"] / 1e6) <= 0.05:
        problems.append(f"{path.name}: states {params[2]}M active parameters, "
                        f"counts {counts['active'] / 1e6:.1f}M")
    gflop = next((m for m in map(GFLOP_LINE.search, header) if m), None)
    counted = flops_per_token(written.model) / 1e9
    if gflop is None or abs(float(gflop[1]) - counted) > 0.005:
        problems.append(f"{path.name}: states {gflop[1] if gflop else 'no'} GFLOP/token, counts {counted:.2f}")
    if load_config(path, layouts.multi_node).to_dict() != written.to_dict():
        problems.append(f"{path.name}: the 8x80GB line ({' '.join(layouts.multi_node)}) is not what the file sets")
    multi = plan(written, layouts.nodes, 8, 80)
    if not multi["fits"]:
        problems.append(f"{path.name}: does not fit on {layouts.nodes} x 8 x 80 GB: {multi['reason']}")
    one = load_config(path, layouts.single_gpu)
    if (one.parallel.tensor, one.parallel.expert) != (1, 1):
        return problems + [f"{path.name}: the single-GPU line must set parallel.tensor=1 parallel.expert=1"]
    alone = plan(one, 1, 1, 80, "h100")
    if not alone["fits"]:
        problems.append(f"{path.name}: the single-GPU layout does not fit in 80 GB: {alone['reason']}")
    if alone["memory_total_gb"] > SINGLE_GPU_SHARE * 80:
        problems.append(f"{path.name}: the single-GPU layout takes {alone['memory_total_gb']:.1f} GB, over "
                        f"{SINGLE_GPU_SHARE:.0%} of 80 GB")
    if one.train.activation_checkpointing != "none":
        two = plan(load_config(path, [*layouts.single_gpu, "train.micro_batch=2", "train.activation_checkpointing=none"]),
                   1, 1, 80, "h100")
        if two["memory_total_gb"] <= SINGLE_GPU_SHARE * 80:
            problems.append(f"{path.name}: the single-GPU layout checkpoints activations, but 2 sequences fit "
                            f"without ({two['memory_total_gb']:.1f} GB)")
    if alone["tokens_per_step"] != multi["tokens_per_step"]:
        problems.append(f"{path.name}: one GPU takes {alone['tokens_per_step']} tokens per step, "
                        f"{layouts.nodes} x 8 GPUs {multi['tokens_per_step']}: set train.grad_accum to match")
    return problems


@pytest.mark.parametrize("path", SIZE_CONFIGS)
def test_size_config_header_layouts_fit(path):
    assert layout_problems(REPO / path) == []


def test_header_check_catches_layouts_that_do_not_fit(tmp_path):
    assert len(SIZE_CONFIGS) >= 20
    text = (REPO / "configs/dense_3b.yaml").read_text()
    lines = text.splitlines(keepends=True)
    nodes = next(line for line in lines if line.startswith(NODES_PREFIX))
    single = next(line for line in lines if line.startswith(SINGLE_GPU_PREFIX))

    def problems(new_text: str) -> str:
        assert new_text != text
        (tmp_path / "dense_3b.yaml").write_text(new_text)
        return "\n".join(layout_problems(tmp_path / "dense_3b.yaml"))

    assert problems(text + "\n") == ""
    def micro(line: str, n: int) -> str:
        return re.sub(r"train\.micro_batch=\d+", f"train.micro_batch={n}", line)

    assert "single-GPU layout does not fit" in problems(text.replace(single, micro(single, 64)))
    # micro-batch 16 on 8 GPUs, stated and set: too big for 80 GB
    too_big = text.replace(nodes, micro(nodes, 16)).replace("  micro_batch: 4\n", "  micro_batch: 16\n")
    assert "does not fit on 1 x 8 x 80 GB" in problems(too_big)
    assert "not what the file sets" in problems(text.replace(nodes, micro(nodes, 8)))
    fewer_tokens = single.replace("grad_accum=16", "grad_accum=1")
    assert "tokens per step" in problems(text.replace(single, fewer_tokens))
    assert "header needs" in problems(text.replace("# single-gpu", "# one-gpu"))
    recomputes = single.replace("train.activation_checkpointing=none", "train.activation_checkpointing=full")
    assert "checkpoints activations, but 2 sequences fit without" in problems(text.replace(single, recomputes))
    assert "over 70% of 80 GB" in problems(text.replace(single, micro(single, 4).replace("grad_accum=16", "grad_accum=8")))
    assert "states 2500.0M parameters" in problems(text.replace("2701.6M parameters", "2500.0M parameters"))
    assert "states 18.00 GFLOP/token, counts 17.73" in problems(text.replace("17.73 GFLOP/token", "18.00 GFLOP/token"))


def test_the_plan_follows_train_precision_and_zero_0():
    """fp32 on a GPU is planned in fp32 (it was planned as bf16); ZeRO-0 in fp32 steps AdamW on the
    weights (no fp32 master) with one all-reduce bucket, in bf16 on an fp32 copy of the gradients."""
    def memory(*overrides: str) -> dict:
        return plan(load_config(REPO / "configs/dense_125m.yaml", list(overrides)), 1, 1, 80, "h100")["memory_gb"]

    bf16, fp32 = memory(), memory("train.precision=fp32")
    assert fp32["weights"] == pytest.approx(2 * bf16["weights"]) and fp32["activations"] > bf16["activations"]
    params = bf16["weights"] / 2  # GiB per byte of every parameter
    zero0_fp32, zero0_bf16 = memory("parallel.zero_stage=0", "train.precision=fp32"), memory("parallel.zero_stage=0")
    assert zero0_fp32["optimizer"] == pytest.approx(8 * params) and zero0_fp32["buffers"] == pytest.approx(4 * params)
    assert zero0_bf16["gradients"] == pytest.approx((2 + 4) * params) and zero0_bf16["buffers"] == 0
    for stage in (1, 2):  # DeepSpeed's reduce and all-gather buckets, each the whole model below 5e8 elements
        assert memory(f"parallel.zero_stage={stage}")["buffers"] == pytest.approx(2 * 2 * params), stage
    # The z-loss's logsumexp comes from the cross-entropy's own pass: no second logits-sized tensor.
    assert memory("train.z_loss=1e-4")["activations"] == bf16["activations"]


def test_gpu_peak_matches_the_specific_variant_first():
    from pretrain.telemetry import PEAK_TFLOPS, peak_tflops

    assert peak_tflops("NVIDIA H100 PCIe") == PEAK_TFLOPS["H100 PCIe"] < peak_tflops("NVIDIA H100 80GB HBM3")
    assert peak_tflops("NVIDIA H100 NVL") == PEAK_TFLOPS["H100 NVL"]
    assert peak_tflops("NVIDIA H200") == PEAK_TFLOPS["H200"] and peak_tflops("h200") == PEAK_TFLOPS["H200"]
    assert peak_tflops("NVIDIA H200 NVL") == PEAK_TFLOPS["H200 NVL"] < PEAK_TFLOPS["H200"]
    assert peak_tflops("Tesla T4") is None  # unknown: MFU is left out rather than guessed
    assert peak_tflops("NVIDIA H100 80GB HBM3", bf16=False) == 67.0  # fp32 runs: no tensor cores


def test_an_fp32_plan_takes_the_fp32_peak():
    from launch.plan import plan
    from pretrain.config import load_config

    cfg = load_config(REPO / "configs/dense_1b.yaml")
    bf16, fp32 = (plan(cfg, 1, 8, 80, "h100", bf16=b) for b in (True, False))
    assert fp32["step_time_s"] / bf16["step_time_s"] == pytest.approx(989 / 67)


def test_full_checkpointing_keeps_the_largest_layer_wherever_it_is():
    """Full checkpointing keeps each layer's input plus one layer's full set for its recompute: the
    largest layer's, first or last, in a model whose layers differ (routed and dense MLPs)."""
    from launch.plan import Layout, activation_bytes

    layout = Layout(world=1, tensor=1, expert=1, data=1, zero_stage=1, micro_batch=2, bf16=True,
                    checkpointing="full")

    def full(*overrides: str) -> float:
        model = load_config(REPO / "configs/125m_moe.yaml", list(overrides)).model
        return activation_bytes(model, layout, model.max_seq_len)

    routed, dense = full("model.moe.moe_layers=all"), full("model.mlp=dense")
    assert routed != dense
    last = load_config(REPO / "configs/125m_moe.yaml").model.num_layers - 1
    for layer in (0, last):
        assert full(f"model.moe.moe_layers={layer}") == pytest.approx(max(routed, dense)), layer


def test_zero_shards_over_data_parallel_ranks_and_experts_over_theirs():
    """ZeRO-1 shards the optimizer states over the data-parallel ranks, ZeRO-2 the gradients too,
    ZeRO-3 the weights too; routed experts (4-way expert parallel over 8 ranks) over the 2 ranks
    holding each expert. bf16: 2-byte weights, 4-byte fp32 gradients (at ZeRO-1 the whole fp32 sum
    DeepSpeed's BF16_Optimizer accumulates in), 12-byte master + moments.
    Selective checkpointing keeps less than none where attention is not flash (fp32: its seq^2
    weights)."""
    from launch.plan import Layout, activation_bytes, memory_breakdown
    from models.counting import expert_params, param_counts

    cfg = load_config(REPO / "configs/125m_moe.yaml")
    experts = expert_params(cfg.model)
    dense = param_counts(cfg.model)["total"] - experts
    local, shard = dense + experts / 4, dense / 8 + experts / 4 / 2

    def layout(zero_stage: int, checkpointing: str = "none", bf16: bool = True) -> Layout:
        return Layout(world=8, tensor=1, expert=4, data=8, zero_stage=zero_stage, micro_batch=2, bf16=bf16,
                      checkpointing=checkpointing)

    want = {0: (2 * local, 2 * local + 4 * local, 12 * local), 1: (2 * local, 2 * local + 4 * local, 12 * shard),
            2: (2 * local, 4 * shard, 12 * shard), 3: (2 * shard, 4 * shard, 12 * shard)}
    for stage, (weights, gradients, optimizer) in want.items():
        got = memory_breakdown(cfg, layout(stage))
        assert (got["weights"], got["gradients"], got["optimizer"]) == \
            pytest.approx((weights, gradients, optimizer)), stage
    seq = cfg.model.max_seq_len
    assert activation_bytes(cfg.model, layout(1, "selective", bf16=False), seq) < \
        activation_bytes(cfg.model, layout(1, bf16=False), seq)


def test_a_post_training_plan_counts_its_rows_and_reference(capsys):
    """--post: SFT at post.max_len = model.max_seq_len plans as pretraining; a DPO pair runs two rows
    and holds a frozen reference (the weights' bytes, split by tensor parallelism, not by ZeRO-3),
    SGA with its value loss a third row, and post.max_len sets the row length."""
    from launch.entry_points import entry_point

    post_class = entry_point(True).config_class

    def planned(method: str, *extra: str, nodes: int = 1) -> dict:
        cfg = load_config("configs/tiny_dense.yaml", [f"post.method={method}", *extra], config_class=post_class)
        return plan(cfg, nodes, 1, 80, "cpu")

    pretrain = plan(load_config("configs/tiny_dense.yaml"), 1, 1, 80, "cpu")
    sft, dpo = planned("sft"), planned("dpo")
    assert sft["memory_gb"] == pretrain["memory_gb"] and "reference" not in sft["memory_gb"]
    assert dpo["memory_gb"]["activations"] == pytest.approx(2 * sft["memory_gb"]["activations"])
    assert dpo["memory_gb"]["reference"] == pytest.approx(dpo["memory_gb"]["weights"])
    assert dpo["memory_total_gb"] > sft["memory_total_gb"] + dpo["memory_gb"]["reference"]
    # Per token, a step also runs the reference forward over the pairs: a third of a training pass.
    assert dpo["tokens_per_s"] == pytest.approx(sft["tokens_per_s"] * 3 / 4)
    simpo = planned("dpo", "post.preference_loss=simpo")  # no reference: the pair's two rows alone
    assert "reference" not in simpo["memory_gb"] and simpo["tokens_per_s"] == pytest.approx(sft["tokens_per_s"])
    assert simpo["memory_gb"]["activations"] == dpo["memory_gb"]["activations"]
    sga = planned("sga", "post.mse_weight=0.5")
    assert sga["memory_gb"]["activations"] == pytest.approx(3 * sft["memory_gb"]["activations"])
    zero3 = planned("dpo", "parallel.zero_stage=3", nodes=2)
    assert zero3["memory_gb"]["reference"] == pytest.approx(2 * zero3["memory_gb"]["weights"])
    half = load_config("configs/tiny_dense.yaml", ["post.max_len=64"], config_class=post_class)
    assert half.tokens_per_row() == 64 and half.rows_per_example() == 1
    shorter = plan(load_config("configs/tiny_dense.yaml", ["model.max_seq_len=64"]), 1, 1, 80, "cpu")
    assert planned("sft", "post.max_len=64")["memory_gb"] == shorter["memory_gb"]
    assert plan_main(["configs/tiny_dense.yaml", "--post", "post.method=dpo", "--gpu", "cpu", "--nodes", "1",
                      "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 8 (16 rows) x 128 tokens" in out and "reference" in out
    assert plan_main(["configs/tiny_dense.yaml", "post.method=dpo", "--gpu", "cpu", "--nodes", "1",
                      "--gpus-per-node", "1"]) == 2
    assert "launch.plan with --post" in capsys.readouterr().err
