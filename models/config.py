"""Model configuration: sizes, the attention kind of every layer, the MLP kind, and the config
sections the kinds declare (model.moe, model.lisa, ...; see models.registry).

Also the typed setter every config tree uses (`apply_values`): YAML and dotted command-line values
become dataclass fields of the declared type, and a bad key or value is a ConfigError that names
the key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field

import yaml


class ConfigError(ValueError):
    """A config problem, stated with the key at fault and the fix."""


# Keys that a machine's hardware may decide (auto), with the spellings a boolean key took.
SWITCH = {"auto": "auto", "true": "true", "false": "false", "1": "true", "0": "false", "yes": "true",
          "no": "false", "on": "true", "off": "false"}


def parse_switch(value, key: str) -> str:
    text = str(value).strip().lower()  # YAML reads true/false as booleans
    if text not in SWITCH:
        raise ConfigError(f"{key}={value!r}: choose auto, true or false")
    return SWITCH[text]


def parse_indices(value, key: str) -> str:
    """A set of indices as written ("all", "3,1", " 1, 3", a YAML list [1, 3], one number) -> its one
    spelling: "all" or the sorted indices "1,3" (so that a resume compares sets, not spellings)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    parts = value if isinstance(value, (list, tuple)) else str(value).strip().strip("[]").split(",")
    try:
        indices = sorted({whole_number(part, key) for part in parts if str(part).strip()})
    except ConfigError:
        indices = None
    if not indices or indices[0] < 0:
        raise ConfigError(f"{key}={value!r}: give 'all' or indices >= 0, as 1,3 or [1, 3]")
    return ",".join(map(str, indices))


def index_set(text: str) -> set[int] | None:
    """A parse_indices value as a set: None for "all"."""
    return None if text == "all" else {int(i) for i in text.split(",")}


@dataclass(init=False, eq=False)
class ModelConfig:
    vocab_size: int = 4096  # tokenizer vocabulary; the embedding is padded to `vocab_pad_to`
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    # Grouped-query attention: key/value heads shared by num_heads / num_kv_heads query heads each
    # (0 = num_heads, multi-head attention). Must divide num_heads and be a multiple of parallel.tensor.
    num_kv_heads: int = 0
    ffn_hidden_size: int = 352
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    vocab_pad_to: int = 128
    # One kind per layer: a list, a comma-separated string, or a compact string of the kinds'
    # letters (built in: s=softmax, k=softmax_sink, r=relu, l=lisa), e.g. "ssrl". One entry repeats.
    attention: str | list[str] = "softmax"
    mlp: str = "dense"
    # Modules that register more kinds and sections (models.registry), imported before the rest
    # of the config is read.
    plugins: list[str] = field(default_factory=list)

    # Keys that steer training, not what the weights mean (a run may change them between checkpoints).
    TRAINING_ONLY: typing.ClassVar[tuple[str, ...]] = ("init_std", "plugins")

    def __init__(self, **values):
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, values.pop(f.name, default))
        object.__setattr__(self, "_sections", {})
        for name, value in values.items():  # config sections, e.g. moe=MoEConfig(...)
            setattr(self, name, value)

    def __getattr__(self, name: str):
        """A config section (cfg.moe, cfg.lisa, ...), at its defaults until set."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._sections:
            self._sections[name] = _section(name).config()
        return self._sections[name]

    def __setattr__(self, name: str, value) -> None:
        if name in MODEL_FIELDS:
            object.__setattr__(self, name, value)
            return
        section = _section(name)
        if not isinstance(value, section.config):
            raise TypeError(f"model.{name} must be a {section.config.__name__}, got {type(value).__name__}")
        self._sections[name] = value

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"ModelConfig({self.to_dict()})"

    def __copy__(self) -> ModelConfig:
        """Fields and section objects shared, the section table not (setting a section on the copy
        leaves the original alone). Copy with copy.deepcopy, not dataclasses.replace, which passes
        the fields only and so resets every section."""
        new = object.__new__(ModelConfig)
        new.__dict__.update(self.__dict__)
        object.__setattr__(new, "_sections", dict(self._sections))
        return new

    def to_dict(self) -> dict:
        """Fields, then the sections of the built-in kinds and of model.plugins' packages (a section
        another module registered in this process belongs to no model until it is a plug-in)."""
        from models import registry

        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name, section in sorted(registry.sections().items()):
            if section.belongs_to(self.plugins):
                out[name] = dataclasses.asdict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """A ModelConfig from a saved dict (a COMPLETE marker, a weights file); keys added since it
        was written take their defaults."""
        from models import registry

        registry.load_plugins(values.get("plugins") or [], "the saved model (a checkpoint's or weights file's)")
        cfg = cls()
        apply_values(cfg, values, "model.")
        return cfg

    def signature(self) -> dict:
        """The settings that fix the weights and what they compute, as flat dotted keys: two
        configs with equal signatures can load each other's checkpoints."""
        from models import registry

        skip = set(self.TRAINING_ONLY) | registry.training_only_keys()
        if all(registry.mlp_kind(self.mlp_kind(layer)).routed for layer in range(self.num_layers)):
            skip.add("ffn_hidden_size")  # every layer's MLP is sized by model.moe.*
        flat = registry.section_signature(self, {k: v for k, v in _flat(self.to_dict()).items() if k not in skip})
        flat["attention"] = ",".join(self.attention_kinds())  # 'ssrl' is 'softmax,softmax,relu,lisa'
        flat["num_kv_heads"] = self.kv_heads  # 0 means one per query head
        return flat

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        pad = self.vocab_pad_to
        return (self.vocab_size + pad - 1) // pad * pad

    def attention_kinds(self) -> list[str]:
        """The attention kind of every layer (the pattern parsed, kinds not yet validated)."""
        return parse_attention_pattern(self.attention, self.num_layers)

    def mlp_kind(self, layer: int) -> str:
        from models import registry

        applies = registry.mlp_kind(self.mlp).applies_to
        return self.mlp if applies is None or applies(self, layer) else "dense"

    def check_sizes(self, tensor: int = 1) -> None:
        """Sizes that every kind relies on, for a model split over `tensor` ranks."""
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "max_seq_len",
                    "vocab_pad_to"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.rope_base <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError(f"model.rope_base={self.rope_base}, model.norm_eps={self.norm_eps} and "
                              f"model.init_std={self.init_std} must be > 0")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dimension {self.head_dim} must be even for rotary embeddings")
        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads} "
                              "(0 = as many K/V heads as query heads)")
        if self.kv_heads % tensor:
            which = (f"model.num_kv_heads={self.num_kv_heads}" if self.num_kv_heads
                     else f"model.num_heads={self.num_heads}")
            raise ConfigError(f"{which} is not divisible by parallel.tensor={tensor}; "
                              "choose a tensor-parallel size that divides the (K/V) heads")
        if self.padded_vocab_size % tensor:
            raise ConfigError(f"the padded vocabulary ({self.padded_vocab_size}, model.vocab_pad_to="
                              f"{self.vocab_pad_to}) must divide by parallel.tensor={tensor}: make "
                              "model.vocab_pad_to a multiple of it")


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def _flat(values: dict, prefix: str = "") -> dict:
    """{"moe": {"top_k": 2}} -> {"moe.top_k": 2}."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _section(name: str):
    from models import registry

    section = registry.sections().get(name)
    if section is None:
        raise AttributeError(f"model has no key or section {name!r} (sections: {sorted(registry.sections())})")
    return section


def parse_attention_pattern(pattern: str | list[str], num_layers: int) -> list[str]:
    from models import registry

    letters = registry.letters()
    known = tuple(sorted(registry.attention_kinds()))
    if isinstance(pattern, str):
        if "," in pattern or pattern in registry.attention_kinds():
            kinds = [p.strip() for p in pattern.split(",") if p.strip()]
        else:
            unknown = sorted(set(pattern) - set(letters))
            close = difflib.get_close_matches(pattern, known, n=1)
            if unknown and close:  # a misspelt kind, not a string of letters
                raise ConfigError(f"model.attention={pattern!r} is no attention kind; did you mean {close[0]!r}? "
                                  f"(kinds {known}, or one letter per layer {letters})")
            if unknown:
                raise ConfigError(
                    f"model.attention={pattern!r}: unknown letters {unknown}; use a list of "
                    f"{known} or letters {letters} (a kind outside models/attention/ registers when its "
                    "module is imported: list it in model.plugins)"
                )
            kinds = [letters[c] for c in pattern]
    else:
        kinds = list(pattern)
    if len(kinds) == 1:
        kinds = kinds * num_layers
    bad = [k for k in kinds if k not in registry.attention_kinds()]
    if bad and all(k in letters for k in kinds):
        raise ConfigError(f"model.attention={pattern!r}: letters go without commas ({''.join(kinds)!r}); kinds "
                          f"are listed with them ({','.join(letters[k] for k in kinds)!r})")
    if bad:
        raise ConfigError(f"model.attention: unknown kinds {bad}; choose from {known} "
                          "(a kind outside models/attention/ registers when its module is imported: list it in "
                          "model.plugins)")
    if len(kinds) != num_layers:
        raise ConfigError(
            f"model.attention lists {len(kinds)} layers but model.num_layers={num_layers}; "
            "give one kind per layer or a single kind for all"
        )
    return kinds


# --- the typed setter ---------------------------------------------------------------------------------

def config_keys(obj) -> list[str]:
    """The keys a config node takes: its fields, and for the model its registered sections."""
    names = [f.name for f in dataclasses.fields(obj)]
    if isinstance(obj, ModelConfig):
        from models import registry

        names += sorted(registry.sections())
    return names


def coerce(value, annotation, key: str, parse=None):
    """A YAML/CLI value as the field's declared type; `parse` (a field's metadata) turns it into
    its one canonical form instead."""
    if parse is not None:
        return parse(value, key)
    hint = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing), {})  # noqa: S307
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and list in [typing.get_origin(a) or a for a in typing.get_args(hint)]:
            text = value.strip()
            if not text.startswith("["):
                return value
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ConfigError(f"{key}={value!r}: not a list ({getattr(err, 'problem', None) or err}); "
                                  "write it as [a, b, c]") from None
        return value
    if origin is list and typing.get_args(hint) == (str,):
        if isinstance(value, str):  # model.plugins=a.b,c.d
            value = [part.strip() for part in value.strip("[]").split(",") if part.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: expected a list of names")
        return [str(v) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if hint is int:
        return whole_number(value, key)
    if hint is float:
        try:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected float (a number)") from None
    if hint is str:
        if isinstance(value, (list, dict)):
            several = " (several shard sets: data.mix=[{shards: A}, {shards: B}])" if key.endswith(".shards") else ""
            raise ConfigError(f"{key}={value!r}: expected one value, not a {type(value).__name__}{several}")
        return str(value)
    return value


def whole_number(value, key: str) -> int:
    """An integer key's value: an int, or a number or text with no fractional part (YAML reads 1e5 as
    text); never a bool or a fraction, which int() would quietly truncate."""
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not float(number).is_integer():
        raise ConfigError(f"{key}={value!r}: expected a whole number")
    return int(number)


def empty_value(field: dataclasses.Field | None, key: str, section: bool):
    """What an empty YAML value (`init_from:`, a section with every key commented out) sets: the
    default, unless the field says an empty value is ambiguous (metadata "empty": the fix)."""
    if section:
        return {}
    if field.metadata.get("empty"):
        raise ConfigError(f"{key} is empty: {field.metadata['empty']}")
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def apply_values(obj, values: dict, prefix: str = "") -> None:
    """Set a config dataclass tree from nested {key: value}; sections recurse."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}  # registered model sections are not among them
    names = config_keys(obj)
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in names:
            plugin = " (a section a plug-in registers: list its module in model.plugins)" if key.count(".") == 1 \
                and key.startswith("model.") else ""
            raise ConfigError(f"unknown config key {key!r}; known keys here: {sorted(names)}{plugin}")
        current = getattr(obj, name)
        section = dataclasses.is_dataclass(current)
        if value is None:
            value = empty_value(fields.get(name), key, section)
        if section:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
            apply_values(current, value, key + ".")
        else:
            setattr(obj, name, coerce(value, hints[name], key, fields[name].metadata.get("parse")))


def normalise(obj, prefix: str = "") -> None:
    """Run the fields' parse functions over a tree set in code; apply_values already ran them on
    what it set, and they leave a canonical value as it is."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            normalise(value, f"{prefix}{f.name}.")
        elif f.metadata.get("parse") is not None:
            setattr(obj, f.name, f.metadata["parse"](value, f"{prefix}{f.name}"))
