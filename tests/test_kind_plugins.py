"""A new attention kind and a new MLP kind, declared in this file alone (nothing else edited), train
at tensor-parallel size 2 and are answered for by counting, the planner, validation and export.

This module is also the plug-in: runs name it in model.plugins, and importing it registers the kinds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.attention.base import ProjectedAttention, projected_activations, projected_params
from models.attention.softmax import softmax_attention
from models.config import ConfigError, ModelConfig
from models.layers import column_linear, row_linear
from models.registry import (
    AttentionKind,
    MLPKind,
    ParallelSizes,
    register_attention,
    register_mlp,
    register_section,
    validate_model,
)
from tests.dist_utils import REPO, child_env, single_process_group, train
from tests.synthetic import tiny_overrides, write_synthetic_shards

PLUGIN = __name__


@dataclass
class ToyAttentionConfig:
    temperature: float = 1.0  # scores are q.k x temperature / sqrt(head_dim)


@dataclass
class ToyMLPConfig:
    width: int = 96


register_section("toy_attention", ToyAttentionConfig)
register_section("toy_mlp", ToyMLPConfig)


class ToyAttention(ProjectedAttention):
    """Causal softmax attention at another temperature; publishes no scores."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.temperature = cfg.toy_attention.temperature

    def core(self, q, k, v, ctx):  # causal with the queries last (decoding), within documents when given
        return softmax_attention(q, k, v, ctx.get("document_ids"), scale=self.temperature / math.sqrt(q.shape[-1]))


class ToyMLP(nn.Module):
    """A GELU MLP (no gate), split over tensor-parallel ranks."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.up = column_linear(cfg, cfg.hidden_size, cfg.toy_mlp.width)
        self.down = row_linear(cfg, cfg.toy_mlp.width, cfg.hidden_size)

    def forward(self, x):
        hidden, _ = self.up(x)
        out, _ = self.down(F.gelu(hidden))
        return out


def check_toy_attention(cfg: ModelConfig, kinds: list[str], sizes: ParallelSizes) -> None:
    if not cfg.toy_attention.temperature > 0:
        raise ConfigError(f"model.toy_attention.temperature={cfg.toy_attention.temperature} must be > 0")


def check_toy_mlp(cfg: ModelConfig, sizes: ParallelSizes) -> None:
    if cfg.toy_mlp.width % sizes.tensor:
        raise ConfigError(f"model.toy_mlp.width={cfg.toy_mlp.width} is not divisible by parallel.tensor={sizes.tensor}")


register_attention(AttentionKind(
    name="toy_attention", module=ToyAttention, params=projected_params,
    activations=lambda cfg, layout: projected_activations(cfg, layout, stores_scores=True),
    validate=check_toy_attention,
))
register_mlp(MLPKind(
    name="toy_mlp", module=ToyMLP, params=lambda cfg: (2 * cfg.hidden_size * cfg.toy_mlp.width,) * 2,
    activations=lambda cfg, layout: 2 * cfg.toy_mlp.width / layout.tensor, validate=check_toy_mlp,
))

TOY = {"model.plugins": f"[{PLUGIN}]", "model.attention": "toy_attention", "model.mlp": "toy_mlp",
       "model.toy_attention.temperature": 0.5, "model.toy_mlp.width": 96}


def toy_config(**extra) -> ModelConfig:
    values = dict(vocab_size=256, hidden_size=64, num_heads=4, num_layers=2, max_seq_len=32,
                  attention="toy_attention", mlp="toy_mlp", plugins=[PLUGIN])
    return ModelConfig(**{**values, **extra})


def test_counting_planner_validation_and_export_answer_for_the_toy_kinds():
    from launch.plan import Layout, activation_bytes
    from models.counting import flops_per_token, param_counts
    from models.gpt import GPT
    from tools.export import ExportError, export_format

    cfg = toy_config(toy_mlp=ToyMLPConfig(width=80))
    with single_process_group():
        model = GPT(cfg)
    counts = param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    d, L, w, s = cfg.hidden_size, cfg.num_layers, 80, cfg.max_seq_len
    assert sum(p.numel() for p in model.blocks[0].mlp.parameters()) == 2 * d * w
    # 6 x active parameters without the embedding and the norms, + 12 x hidden x seq per layer (the
    # default score term)
    matmul = counts["total"] - cfg.padded_vocab_size * d - (2 * L + 1) * d
    assert flops_per_token(cfg) == 6 * matmul + 12 * L * d * s
    # The planner takes each layer's activations from the kinds: the toy MLP's 2w/t per token.
    layout = Layout(world=2, tensor=2, expert=1, data=1, zero_stage=1, micro_batch=4, bf16=False, checkpointing="none")
    wider = toy_config(toy_mlp=ToyMLPConfig(width=160))
    assert activation_bytes(wider, layout, s) - activation_bytes(cfg, layout, s) == 4 * s * L * (2 * 80 / 2) * 4
    assert cfg.to_dict()["toy_mlp"] == {"width": 80} and ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ExportError, match=r"kind\(s\) \['toy_attention', 'toy_mlp'\] have no Hugging Face export"):
        export_format(cfg)
    # Validation runs the kinds' own checks, and the registry's rules about them.
    validate_model(cfg, ParallelSizes(tensor=2))
    with pytest.raises(ConfigError, match="model.toy_mlp.width=81 is not divisible by parallel.tensor=2"):
        validate_model(toy_config(toy_mlp=ToyMLPConfig(width=81)), ParallelSizes(tensor=2))
    with pytest.raises(ConfigError, match="temperature=0.0 must be > 0"):
        validate_model(toy_config(toy_attention=ToyAttentionConfig(temperature=0.0)))
    with pytest.raises(ConfigError, match=r"layer 1 is lisa, which reuses attention scores, but its source layer "
                                          r"\(toy_attention\) publishes none"):
        validate_model(toy_config(attention="toy_attention,lisa", lisa=_lisa(keep_full_layers=1)))


def _lisa(**values):
    from models.attention.lisa import LISAConfig

    return LISAConfig(**values)


def test_an_unregistered_kind_is_an_error_everywhere():
    from models.counting import param_counts
    from pretrain.config import load_config

    cfg = ModelConfig(attention=["softmax", "nonesuch"])
    with pytest.raises(ConfigError, match=r"unknown kinds \['nonesuch'\].*list it in model.plugins"):
        param_counts(cfg)
    with pytest.raises(ConfigError, match="model.mlp='nonesuch': choose one of"):
        param_counts(ModelConfig(mlp="nonesuch"))
    with pytest.raises(ConfigError, match="model.plugins names 'no.such.module', which cannot be imported"):
        load_config(None, ["model.plugins=[no.such.module]"])
    with pytest.raises(ConfigError, match="model.plugins of the saved model .* names 'gone_kinds'.*needs it"):
        ModelConfig.from_dict({"plugins": ["gone_kinds"]})  # a checkpoint's plug-in: no config to edit


def test_a_lisa_layer_after_a_relu_family_plugin_answers_for_the_relu_normaliser(monkeypatch):
    """A LISA layer reading a relu-family layer's scores applies model.relu_attention.normalizer: that
    key fixes what it computes (checkpoint compatibility) and is checked, even when the relu-family
    layer is a plug-in kind that declares no section."""
    from models import registry
    from models.attention.lisa import LISAConfig
    from models.attention.relu import ReLUAttentionConfig

    relu_family = AttentionKind(name="relu_toy", module=ToyAttention, params=projected_params,
                                activations=projected_activations, score_family="relu", sections=(),
                                origin="their_kinds")
    monkeypatch.setitem(registry._attention, "relu_toy", relu_family)

    def model(normalizer: str, first: str = "relu_toy") -> ModelConfig:
        return ModelConfig(attention=[first, "lisa"], lisa=LISAConfig(keep_full_layers=1, align_group=2),
                           relu_attention=ReLUAttentionConfig(normalizer=normalizer))

    assert model("prefix").signature() != model("content").signature()
    from models.attention.relu import reads_row_length

    assert reads_row_length(model("seqlen")) and not reads_row_length(model("prefix"))  # no cache, scored alone
    assert not reads_row_length(model("seqlen", "softmax"))
    assert model("prefix", "softmax").signature() == model("content", "softmax").signature()  # not read there
    with pytest.raises(ConfigError, match="model.relu_attention.normalizer='bogus': choose one of .*a LISA layer"):
        validate_model(model("bogus"), ParallelSizes())


def test_plugin_names_letters_and_collisions_are_config_errors(tmp_path, monkeypatch):
    """A kind spelt in pattern letters would make model.attention read two ways ("sk": softmax then
    softmax_sink, or that kind); a letter must be one character; a name another module registered
    is refused naming the plug-in entry."""
    from models import registry

    spelt = AttentionKind(name="sk", module=ToyAttention, params=projected_params, activations=projected_activations,
                          origin="their_kinds")
    monkeypatch.setitem(registry._attention, "sk", spelt)
    with pytest.raises(ConfigError, match="attention kind 'sk' .* is spelt in the pattern letters.*rename it"):
        ModelConfig(attention="sk").attention_kinds()
    monkeypatch.delitem(registry._attention, "sk")
    lettered = AttentionKind(name="wide_toy", letter="wt", module=ToyAttention, params=projected_params,
                             activations=projected_activations, origin="their_kinds")
    monkeypatch.setitem(registry._attention, "wide_toy", lettered)
    with pytest.raises(ConfigError, match="has the letter 'wt': a letter is one character"):
        registry.letters()
    monkeypatch.delitem(registry._attention, "wide_toy")
    (tmp_path / "clashing_kinds.py").write_text(
        "from models.attention.softmax import SoftmaxAttention\n"
        "from models.attention.base import projected_activations, projected_params\n"
        "from models.registry import AttentionKind, register_attention\n"
        "register_attention(AttentionKind(name='softmax', module=SoftmaxAttention, params=projected_params,\n"
        "                                 activations=projected_activations))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="model.plugins entry 'clashing_kinds': attention kind 'softmax' is "
                                          "registered twice"):
        registry.load_plugins(["clashing_kinds"])


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_toy_kinds_train_at_tensor_parallel_2_as_at_1(tmp_path, capsys):
    """Two steps at TP=2 give the single-process losses; the checkpoint remembers the plug-in, so
    tools load it without being told, and export refuses it with the kinds' names."""
    from tools.consolidate import main as consolidate_main
    from tools.export import main as export_main

    data = write_synthetic_shards(tmp_path / "data", train=64, val=8)
    runs = {}
    for tp in (1, 2):
        runs[tp] = tmp_path / f"tp{tp}"
        overrides = {**TOY, "train.steps": 2, "train.warmup_steps": 0, "train.eval_interval": 2,
                     "train.save_interval": 2, "parallel.tensor": tp}
        out = train(tp, tiny_overrides(data, runs[tp], **overrides))
        assert "step 2/2" in out.stdout
    assert losses(runs[2]) == pytest.approx(losses(runs[1]), rel=1e-5)
    marker = json.loads((runs[2] / "checkpoints" / "step_00000002" / "COMPLETE").read_text())
    assert marker["model"]["plugins"] == [PLUGIN] and marker["model"]["toy_attention"] == {"temperature": 0.5}
    assert export_main(["--checkpoint", str(runs[2]), "--out", str(tmp_path / "hf")]) == 2
    assert "['toy_attention', 'toy_mlp'] have no Hugging Face export" in capsys.readouterr().err
    with single_process_group():
        assert consolidate_main(["--checkpoint", str(runs[2]), "--out", str(tmp_path / "toy.pt")]) == 0
    state = torch.load(tmp_path / "toy.pt", weights_only=False)["state_dict"]
    assert state["blocks.0.mlp.up.weight"].shape == (96, 64)  # both TP halves, joined


def test_a_checkpoint_from_before_a_plugin_resumes_with_it():
    """A plug-in added to a run counts at its defaults on the checkpoint's side; only a section
    value that differs from them makes it another model."""
    from pretrain.checkpoint import check_compatible
    from pretrain.checkpoint_format import CheckpointError

    marker = {"model": ModelConfig().to_dict()}
    assert "toy_attention" not in marker["model"]
    check_compatible(marker, ModelConfig(plugins=[PLUGIN]).to_dict(), None, "ckpt")
    hotter = ModelConfig(plugins=[PLUGIN], toy_attention=ToyAttentionConfig(temperature=2.0))
    with pytest.raises(CheckpointError, match="toy_attention.temperature: checkpoint 1.0 vs config 2.0"):
        check_compatible(marker, hotter.to_dict(), None, "ckpt")


def test_a_plugin_package_owns_the_sections_its_modules_declare(tmp_path, monkeypatch):
    package = tmp_path / "toy_package_kinds"
    package.mkdir()
    (package / "__init__.py").write_text("from . import sections\n")
    (package / "sections.py").write_text(
        "from dataclasses import dataclass\nfrom models.registry import register_section\n\n"
        "@dataclass\nclass Knob:\n    turns: int = 3\n\nregister_section('toy_knob', Knob)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from models.registry import load_plugins

    load_plugins(["toy_package_kinds"])
    cfg = ModelConfig(plugins=["toy_package_kinds"])
    cfg.toy_knob.turns = 5
    assert cfg.to_dict()["toy_knob"] == {"turns": 5}
    assert ModelConfig.from_dict(cfg.to_dict()).toy_knob.turns == 5
    assert "toy_knob" not in ModelConfig().to_dict()  # a config that does not list the plug-in


NO_TRITON = """
import sys
sys.modules["triton"] = None  # as on a machine without Triton: importing it fails
import torch
from models.attention.lisa import LISAConfig
from models.config import ModelConfig
from models.counting import param_counts
from models.gpt import GPT
from tests.dist_utils import single_process_group

cfg = ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, num_layers=4, ffn_hidden_size=96, max_seq_len=16,
                  attention="skrl", vocab_pad_to=64, lisa=LISAConfig(align_group=2, keep_full_layers=1))
with single_process_group():
    model = GPT(cfg)
    tokens = torch.randint(0, 128, (2, 17))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
assert param_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())
print("loss", float(loss))
"""


def test_models_build_count_and_train_without_triton():
    """Triton kernels are imported only on a GPU: every kind registers, counts and runs without it."""
    proc = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "loss" in proc.stdout, proc.stderr[-3000:]
