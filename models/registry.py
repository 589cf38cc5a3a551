"""Attention and MLP kinds as plug-ins: each kind is declared once, in its own module, next to its
nn.Module, and everything else (building, validation, parameter and FLOP counts, the planner's
memory terms, checkpoint compatibility, export) asks this registry.

    register_attention(AttentionKind(name="softmax", letter="s", module=SoftmaxAttention, params=...))
    register_mlp(MLPKind(name="dense", module=lambda cfg, layer: SwiGLU(cfg), params=...))
    register_section("relu_attention", ReLUAttentionConfig, training_only=("block_size", "kernel"))

A registered section becomes a key of the model config (model.relu_attention.normalizer). The
modules of models/attention/, models/mlp/ and models/moe/ register the built-in kinds when a kind
is first looked up; a kind anywhere else registers when its module is imported, which a run does
for every module named in model.plugins. Looking up a kind nobody registered is an error.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.config import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from models.config import ModelConfig

BUILTIN_PACKAGES = ("models.attention", "models.mlp", "models.moe")


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout a model is validated for (model-parallel sizes only)."""
    tensor: int = 1
    expert: int = 1


@dataclass(frozen=True)
class ActivationLayout:
    """What the planner's activation terms depend on."""
    tensor: int  # tensor-parallel size
    seq: int
    flash: bool  # softmax attention runs a fused kernel that keeps no scores (bf16 on GPU)
    selective: bool  # train.activation_checkpointing=selective: the attention core is recomputed
    # SwiGLU runs fused (on a GPU: eagerly its Triton kernel; compiled blocks keep as much), keeping
    # gate/up and the product but not SiLU's output (models.layers.swiglu_kept)
    fused_swiglu: bool = False


@dataclass(frozen=True)
class LlamaMapping:
    """How a layer's part maps onto transformers' LlamaForCausalLM, both ways:
    to_llama(cfg, state, src, dst) takes this framework's full (TP=1) tensors under prefix src
    (e.g. "blocks.3.attn.") and returns Llama's under prefix dst ("model.layers.3.self_attn.");
    from_llama(cfg, state, src, dst) is the inverse."""
    to_llama: Callable[[ModelConfig, dict, str, str], dict]
    from_llama: Callable[[ModelConfig, dict, str, str], dict]


@dataclass(frozen=True)
class AttentionKind:
    name: str
    module: Callable[[ModelConfig, int], nn.Module]  # (cfg, layer) -> that layer's attention
    params: Callable[[ModelConfig], int]  # parameters of one layer
    # Activation elements per token one layer keeps for the backward pass (planner).
    activations: Callable[[ModelConfig, ActivationLayout], float]
    letter: str = ""  # its letter in compact patterns (model.attention=ssrl)
    # Elements per token one layer hands to the next that stay alive until the backward pass, under
    # full activation checkpointing too (planner; LISA's kept chain scores).
    handed_on: Callable[[ModelConfig, ActivationLayout], float] | None = None
    # Training FLOPs per token beyond 6 x parameters: the score and value products (Megatron's
    # 12 x hidden x seq per layer unless the kind says otherwise).
    score_flops: Callable[[ModelConfig, int], float] | None = None
    # The weight function ("softmax" or "relu") a LISA layer applies to this kind's pre-activation
    # scores when it reuses them; None: the kind publishes no scores.
    score_family: str | None = None
    reads_previous_scores: bool = False  # LISA: the layer reuses the previous layer's scores
    # Checks of the keys this kind reads, run before anything is built; raises ConfigError.
    validate: Callable[[ModelConfig, list[str], ParallelSizes], None] | None = None
    llama: LlamaMapping | None = None  # Hugging Face export as Llama attention
    hf_remote: bool = False  # the bundled modeling file (models/hf) implements it
    # The config sections that fix what this kind's layers hold and compute (checkpoint compatibility:
    # a model none of whose layers reads a section loads checkpoints whatever the section says; None:
    # not declared, so a model with this kind compares every section) ...
    sections: tuple[str, ...] | None = None
    # ... and, where only some of their keys do or a key can be spelled two ways, those keys resolved:
    # cfg -> {"section.key": value}; None: every key of the sections but the training-only ones.
    signature: Callable[[ModelConfig], dict] | None = None
    origin: str = ""  # the registering module (set by register_attention)


@dataclass(frozen=True)
class MLPKind:
    name: str
    module: Callable[[ModelConfig, int], nn.Module]  # (cfg, layer) -> that layer's MLP
    params: Callable[[ModelConfig], tuple[int, int]]  # (total, active per token) of one layer
    # Activation elements per token one layer keeps for the backward pass (planner).
    activations: Callable[[ModelConfig, ActivationLayout], float]
    # Parameters of one layer that expert parallelism shards (the routed experts).
    expert_params: Callable[[ModelConfig], int] | None = None
    routed: bool = False  # experts in DeepSpeed's MoE container: expert parallelism, ZeRO 0-2 only
    # Which layers take this kind (the others are dense); None: every layer.
    applies_to: Callable[[ModelConfig, int], bool] | None = None
    validate: Callable[[ModelConfig, ParallelSizes], None] | None = None
    llama: LlamaMapping | None = None
    hf_remote: bool = False
    sections: tuple[str, ...] | None = None  # as AttentionKind's
    signature: Callable[[ModelConfig], dict] | None = None
    origin: str = ""


@dataclass(frozen=True)
class Section:
    """A config section a kind reads: model.<name>.<key>."""
    name: str
    config: type
    training_only: tuple[str, ...] = ()  # keys that steer training, not what the weights mean
    origin: str = ""

    def belongs_to(self, plugins: list[str]) -> bool:
        """Part of a model config that lists `plugins`: built in, or declared in the package of one."""
        packages = {name.split(".")[0] for name in plugins}
        return self.origin.startswith("models.") or self.origin.split(".")[0] in packages


_attention: dict[str, AttentionKind] = {}
_mlp: dict[str, MLPKind] = {}
_sections: dict[str, Section] = {}
_builtins = "not loaded"  # -> "loading" -> "loaded"
_plugin_loading: str | None = None  # the model.plugins module being imported


def _origin() -> str:
    """Where a registration comes from: the plug-in being loaded, else the module that called
    register_*."""
    return _plugin_loading or sys._getframe(2).f_globals.get("__name__", "")


def _add(table: dict, what: str, name: str, entry) -> None:
    old = table.get(name)
    if old is not None and old.origin != entry.origin:
        raise ConfigError(f"{what} {name!r} is registered twice: by {old.origin} and by {entry.origin}; rename one")
    table[name] = entry


def register_attention(kind: AttentionKind) -> AttentionKind:
    kind = dataclasses.replace(kind, origin=kind.origin or _origin())
    _add(_attention, "attention kind", kind.name, kind)
    return kind


def register_mlp(kind: MLPKind) -> MLPKind:
    kind = dataclasses.replace(kind, origin=kind.origin or _origin())
    _add(_mlp, "MLP kind", kind.name, kind)
    return kind


def register_section(name: str, config: type, training_only: tuple[str, ...] = ()) -> type:
    from models.config import ModelConfig

    if hasattr(ModelConfig, name) or name in ModelConfig.__annotations__:
        raise ConfigError(f"config section {name!r} would hide model.{name}; choose another name")
    _add(_sections, "config section", name, Section(name, config, tuple(training_only), _origin()))
    return config


def load_builtins() -> None:
    """Import every module of the built-in kind packages (each registers what it defines)."""
    global _builtins
    if _builtins != "not loaded":  # done, or under way (a kind module being imported looks kinds up)
        return
    _builtins = "loading"
    try:
        for package in BUILTIN_PACKAGES:
            for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
                importlib.import_module(f"{package}.{info.name}")
    except BaseException:
        _builtins = "not loaded"
        raise
    _builtins = "loaded"


def load_plugins(modules: list[str], source: str = "") -> None:
    """Import the modules of model.plugins (after the built-in kinds), which register kinds and
    sections of their own. `source`: whose list it is when not the config's (a checkpoint's)."""
    global _plugin_loading
    load_builtins()
    for name in modules:
        _plugin_loading = name
        try:
            importlib.import_module(name)
        except ImportError as err:
            fix = (f"put the module on PYTHONPATH ({source} needs it)" if source else
                   "put the module on PYTHONPATH or remove it from model.plugins")
            raise ConfigError(f"model.plugins{' of ' + source if source else ''} names {name!r}, which cannot be "
                              f"imported ({err}); {fix}") from None
        except ConfigError as err:  # a name or section another module registered
            raise ConfigError(f"model.plugins entry {name!r}: {err}") from None
        finally:
            _plugin_loading = None


def attention_kinds() -> types.MappingProxyType[str, AttentionKind]:
    load_builtins()
    return types.MappingProxyType(_attention)


def mlp_kinds() -> types.MappingProxyType[str, MLPKind]:
    load_builtins()
    return types.MappingProxyType(_mlp)


def sections() -> types.MappingProxyType[str, Section]:
    load_builtins()
    return types.MappingProxyType(_sections)


def _lookup(kinds: dict, name: str, key: str, home: str):
    if name not in kinds:
        raise ConfigError(f"{key}={name!r}: choose one of {tuple(sorted(kinds))} (a kind outside {home} registers "
                          "when its module is imported: list the module in model.plugins)")
    return kinds[name]


def attention_kind(name: str) -> AttentionKind:
    return _lookup(attention_kinds(), name, "model.attention", "models/attention/")


def mlp_kind(name: str) -> MLPKind:
    return _lookup(mlp_kinds(), name, "model.mlp", "models/mlp/ and models/moe/")


def letters() -> dict[str, str]:
    """{letter: kind} of the compact attention patterns; two kinds with one letter are an error."""
    table: dict[str, AttentionKind] = {}
    for kind in attention_kinds().values():
        if kind.letter and kind.letter in table:
            other = table[kind.letter]
            raise ConfigError(f"attention kinds {other.name!r} ({other.origin}) and {kind.name!r} ({kind.origin}) "
                              f"both use the letter {kind.letter!r}; give one of them another letter or none")
        if kind.letter:
            if len(kind.letter) != 1 or kind.letter in ", ":
                raise ConfigError(f"attention kind {kind.name!r} ({kind.origin}) has the letter {kind.letter!r}: a "
                                  "letter is one character other than a comma or a space")
            table[kind.letter] = kind
    # A name spelt in letters would read both ways in model.attention ("sk": two layers, or one kind).
    for kind in attention_kinds().values():
        if set(kind.name) <= set(table):
            raise ConfigError(f"attention kind {kind.name!r} ({kind.origin}) is spelt in the pattern letters "
                              f"{sorted(table)}, so model.attention={kind.name!r} would read both ways; rename it")
    return {letter: kind.name for letter, kind in table.items()}


def build_attention(cfg: ModelConfig, layer: int) -> nn.Module:
    kinds = cfg.attention_kinds()
    module = attention_kind(kinds[layer]).module(cfg, layer)
    # A layer that reuses scores needs the previous one to hand them over.
    module.publish_scores = layer + 1 < len(kinds) and attention_kind(kinds[layer + 1]).reads_previous_scores
    return module


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    return mlp_kind(cfg.mlp_kind(layer)).module(cfg, layer)


def score_source(kinds: list[str], layer: int) -> str | None:
    """The nearest layer at or before `layer` whose kind computes its own scores (a LISA layer's
    source: whose attention function it keeps); None when there is none."""
    for kind in reversed(kinds[:layer + 1]):
        if not attention_kind(kind).reads_previous_scores:
            return kind
    return None


def validate_pattern(kinds: list[str]) -> None:
    """Every layer that reuses scores has a source that publishes them."""
    for layer, kind in enumerate(kinds):
        if not attention_kind(kind).reads_previous_scores:
            continue
        publishing = sorted(k.name for k in attention_kinds().values() if k.score_family)
        if layer == 0:
            raise ConfigError(
                f"model.attention: layer 0 is {kind}, but a {kind} layer reuses the previous layer's attention "
                f"scores and layer 0 has none; start with one of {publishing}")
        source = score_source(kinds, layer)
        if attention_kind(source).score_family is None:
            raise ConfigError(
                f"model.attention: layer {layer} is {kind}, which reuses attention scores, but its source layer "
                f"({source}) publishes none; put one of {publishing} before it")


def validate_model(cfg: ModelConfig, sizes: ParallelSizes = ParallelSizes()) -> None:
    """Every model.* key, for a model split `sizes` ways; raises ConfigError naming the key and the fix."""
    cfg.check_sizes(sizes.tensor)
    kinds = cfg.attention_kinds()
    validate_pattern(kinds)
    for name in dict.fromkeys(kinds):
        kind = attention_kind(name)
        if kind.validate is not None:
            kind.validate(cfg, kinds, sizes)
    mlp = mlp_kind(cfg.mlp)
    if mlp.validate is not None:
        mlp.validate(cfg, sizes)  # first: it checks which layers take it (applies_to)
    for name in dict.fromkeys(cfg.mlp_kind(i) for i in range(cfg.num_layers)):
        other = mlp_kind(name)
        if name != cfg.mlp and other.validate is not None:
            other.validate(cfg, sizes)


def _used_kinds(cfg: ModelConfig) -> list:
    used = [attention_kind(name) for name in dict.fromkeys(cfg.attention_kinds())]
    return used + [mlp_kind(name) for name in dict.fromkeys(cfg.mlp_kind(i) for i in range(cfg.num_layers))]


def unread_sections(cfg: ModelConfig) -> list[str]:
    """Sections set away from their defaults that none of the model's layers reads (model.moe.* on a
    dense model): settings that change nothing, most likely a mistake. None where a kind of the
    model does not declare what it reads."""
    used = _used_kinds(cfg)
    if any(kind.sections is None for kind in used):
        return []
    read = {name for kind in used for name in kind.sections}
    return [name for name, section in sections().items()
            if name not in read and getattr(cfg, name, None) != section.config()]


def section_signature(cfg: ModelConfig, flat: dict) -> dict:
    """`flat` (the model's dotted keys) with each section that kinds declare replaced by what the
    kinds of this model read of it: left out where none of its layers does, narrowed to the keys a
    kind's signature names. A section no kind declares stays whole, and so does every section where
    one of the model's kinds declares none (sections=None: it may read any)."""
    used = _used_kinds(cfg)
    if any(kind.sections is None for kind in used):
        return dict(flat)
    every_kind = [*attention_kinds().values(), *mlp_kinds().values()]
    declared = {name for kind in every_kind for name in kind.sections or ()}
    out = dict(flat)
    for name in declared:
        readers = [kind for kind in used if name in kind.sections]
        if readers and all(kind.signature is None for kind in readers):
            continue  # read whole
        out = {key: value for key, value in out.items() if not key.startswith(f"{name}.")}
        for kind in readers:
            if kind.signature is None:  # another reader narrows it; this one reads it whole
                out.update({key: value for key, value in flat.items() if key.startswith(f"{name}.")})
            else:
                out.update(kind.signature(cfg))
    return out


def training_only_keys() -> set[str]:
    """Dotted section keys that a run may change between checkpoints."""
    return {f"{s.name}.{key}" for s in sections().values() for key in s.training_only}
