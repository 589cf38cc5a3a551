"""The run's config tree: typed dataclasses, loaded from YAML, overridden by dotted CLI keys and
parsed once into canonical values (models.config.apply_values), then validated before any process
group, model or data loader is built."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data_prep.tokenizer import MODEL_FILE, tokenizer_record
from models import registry
from models.config import (
    ConfigError,
    ModelConfig,
    _flat,
    apply_values,
    index_set,
    normalise,
    parse_indices,
    parse_switch,
)
from pretrain.batch_ramp import validate_batch_ramp
from pretrain.schedule import validate_schedule


class LayoutError(ConfigError):
    """The config does not fit the number of processes it is launched on (a launcher may suggest a layout)."""


@dataclass(frozen=True)
class DataSource:
    name: str  # "" for the single source of data.shards
    shards: str
    weight: float = 1.0


MIX_KEYS = {"shards", "weight", "name"}


def parse_mix(value, key: str = "data.mix") -> list[DataSource]:
    """data.mix as typed sources: names default to the directory name, weights > 0, names distinct."""
    if value is None:  # `mix:` left empty in YAML
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{key}={value!r}: give a list of sources, e.g. "
                          f"{key}='[{{shards: data/web, weight: 0.7}}, {{shards: data/code, weight: 0.3}}]'")
    sources = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(entry, DataSource):
            entry = dataclasses.asdict(entry)
        if isinstance(entry, dict) and (unknown := sorted(map(str, set(entry) - MIX_KEYS))):
            raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; an entry "
                              "takes shards, weight and name")
        if not isinstance(entry, dict) or "shards" not in entry:
            raise ConfigError(f"{where}={entry!r}: give a mapping with shards (and optionally weight, name), "
                              "e.g. {shards: data/web, weight: 0.7}")
        try:
            if isinstance(entry.get("weight"), bool):
                raise TypeError
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.weight={entry['weight']!r}: expected a number") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise ConfigError(f"{where}.weight={weight}: must be a number > 0 (leave the source out instead)")
        shards = str(entry["shards"])
        name = str(entry.get("name") or Path(shards.rstrip("/")).name)
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{where}: name {name!r} must be letters, digits, - or _ (it names the val/ "
                              f"scalars); set {where}.name")
        sources.append(DataSource(name, shards, weight))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key} names {names} repeat (a source's name defaults to its folder's name); give each "
                          f"entry a distinct name: {key}='[{{shards: A, name: web}}, {{shards: B, name: books}}]'")
    return sources


def parse_val_sets(value, key: str = "eval.val_sets") -> list[DataSource]:
    """eval.val_sets: [{shards, name}, ...], held-out shard sets (no weight: nothing is drawn from them)."""
    for i, entry in enumerate(value or []):
        # (a saved config writes the weight every DataSource has, 1.0)
        if isinstance(entry, dict) and entry.get("weight", 1.0) != 1.0:
            raise ConfigError(f"{key}[{i}]: a validation set has no weight (training reads none of it); give shards "
                              "and name")
    return parse_mix(value, key)


def parse_checkpointing(value, key: str) -> str:
    from models.gpt import checkpoint_mode

    try:
        return checkpoint_mode(value)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def switched_on(value) -> bool:
    """An auto / true / false key (parse_switch) on this machine: auto is on where a GPU is."""
    value = parse_switch(value, "switch")  # also a boolean set in code
    if value == "auto":
        import torch

        return torch.cuda.is_available()
    return value == "true"


@dataclass
class DataConfig:
    shards: str = "data/shards"  # directory with train/, val/ and manifest.json (or a remote URL)
    # A training mixture instead of `shards`: [{shards: DIR_OR_URL, weight: W, name: N}, ...]. Each
    # source's train split makes up weight / sum(weights) of the samples (repeated where that share
    # exceeds its size); validation reports every source's val split on its own. `name` defaults to
    # the directory name.
    mix: list[DataSource] = field(default_factory=list, metadata={"parse": parse_mix})
    cache: str = ""  # for remote or compressed shards, a folder per node (default: see README)
    tokenizer: str = "data/tokenizer"
    num_workers: int = 0
    shuffle_seed: int = 1234
    num_canonical_nodes: int = 1  # keep fixed for a run: it defines the sample order
    # Attention within documents: each sample's documents (split after every EOS, the id in the
    # shards' manifest) attend only to themselves, in training and validation.
    document_mask: bool = False
    # Every sample begins with BOS (the id in the shards' manifest): prepended at load time, the
    # sample's last token dropping off, unless the sample already begins with it. Attention-sink
    # metrics read the weight on the first token, which is then always the same token.
    start_with_bos: bool = False
    # Uniformly random tokens instead of shards (pretrain/synthetic_data.py): a smoke test of a
    # config, its memory and speed, before data exists; data.shards, mix and tokenizer are not read.
    synthetic: bool = False

    @property
    def sources(self) -> list[DataSource]:
        """The shard sets training reads: data.mix when given, else data.shards."""
        return list(self.mix) or [DataSource("", self.shards)]


@dataclass
class ParallelConfig:
    tensor: int = 1
    expert: int = 1
    zero_stage: int = 1


def parse_resume(value, key: str) -> str:
    """train.resume: auto and none in any case (the text None too), else a checkpoint path as given."""
    text = str(value).strip()
    return text.lower() if text.lower() in ("auto", "none") else text


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch: int = 4
    grad_accum: int = 1
    # Global batch (samples) of the first step, growing linearly over batch_ramp_steps steps to
    # micro_batch x grad_accum x data-parallel size (0: no ramp; pretrain.batch_ramp)
    batch_ramp_start: int = 0
    batch_ramp_steps: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay; pretrain.schedule)
    decay_fraction: float = 0.2  # wsd: the last share of train.steps that decays to min_lr_ratio
    decay_shape: str = "linear"  # wsd: linear | sqrt (1 - sqrt(progress))
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    z_loss: float = 0.0  # coefficient of mean(logsumexp(LM logits)^2) in the loss; 0 = off (1e-4 is usual)
    # Skip optimizer steps whose loss or grad norm is more than spike_sigmas standard deviations above
    # the mean of the last spike_window applied steps (pretrain.spikes).
    skip_spikes: bool = False
    spike_sigmas: float = 6.0
    spike_window: int = 128
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # torch's fused AdamW: auto (on GPU) | true | false
    fused_optimizer: str = field(default="auto", metadata={"parse": parse_switch})
    # none | full | selective (true/false = full/none)
    activation_checkpointing: str = field(default="none", metadata={"parse": parse_checkpointing})
    # torch.compile each block (UoE/MoE: routing statistics eager): auto (on GPU) | true | false.
    # false by default: CPUs compile slowly, and kinds not yet timed on a GPU stay eager unless asked.
    compile: str = field(default="false", metadata={"parse": parse_switch})
    eval_interval: int = 50
    eval_batches: int = 4
    log_interval: int = 10
    save_interval: int = 100
    keep_last: int = 3
    keep_every: int = 0  # checkpoints of steps that are multiples of it stay beyond keep_last (0: none)
    # Save also when this many minutes passed since the last save (0: off), for jobs killed without
    # warning; these checkpoints count against keep_last like any other (pretrain.save_timer).
    save_interval_minutes: float = 0.0
    resume: str = field(default="auto", metadata={  # auto | none | <checkpoint tag directory>
        "parse": parse_resume,
        "empty": "give auto (the newest checkpoint), none (start afresh) or a checkpoint directory"})
    # Weights to start from when there is nothing to resume: a checkpoint of this model at any layout
    # (pretrain.init_from); optimizer, schedule and data start fresh.
    init_from: str = ""
    stop_at_step: int = 0  # save and exit at this step (0 = run to train.steps); the schedule still spans train.steps
    # Save and stop once this many minutes passed since the start (0: off), as on Slurm's time-limit
    # signal (stop marker, exit code 85; a Slurm job requeues): for schedulers that end jobs unwarned.
    stop_after_minutes: float = 0.0


MAX_TIMER_MINUTES = 1e7  # about 19 years; setitimer overflows near 1.5e8 minutes


@dataclass
class ProfileConfig:
    """torch.profiler traces of steps [start_step, start_step + steps) into RUN_DIR/profile (pretrain.profiling)."""
    start_step: int = 0  # 0 = off
    steps: int = 3
    ranks: str = field(default="0", metadata={"parse": parse_indices})  # global ranks (0,8 or [0, 8]), or "all"
    memory: bool = False  # record allocations too (memory timeline in the trace)


def parse_paths(value, key: str) -> list[str]:
    """A list of paths: a YAML list, or one comma-separated string."""
    if value in (None, ""):
        return []
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return list(value)
    raise ConfigError(f"{key}={value!r}: give a list of file paths (or one comma-separated string)")


@dataclass
class EvalConfig:
    """Downstream multiple-choice tasks scored in the loop (pretrain.downstream)."""
    downstream_tasks: list[str] = field(default_factory=list, metadata={"parse": parse_paths})  # JSONL files
    downstream_interval: int = 0  # every this many steps, and at the last step; 0 = off
    downstream_limit: int = 0  # examples per task (the first ones); 0 = all
    # Held-out shard sets validated beside the training sources ([{shards: DIR_OR_URL, name: N}]): their
    # val split, or all of a set built with --val-fraction 0 (its train split); val/N/loss each, kept
    # out of val/loss.
    val_sets: list[DataSource] = field(default_factory=list, metadata={"parse": parse_val_sets})
    # Prompts continued greedily every train.eval_interval steps and at the last, sample_tokens new
    # tokens each, printed and logged as text samples/<i> (pretrain.generation_samples)
    sample_prompts: list[str] = field(default_factory=list)
    sample_tokens: int = 32


@dataclass
class RunConfig:
    name: str = "demo"
    dir: str = "runs/demo"
    # Callbacks of your own, "package.module:name": a Callback subclass or a function, called with the
    # run's Config, that returns a Callback (pretrain.trainer.Callback: logging to a tracker, ...).
    callbacks: list[str] = field(default_factory=list)


def resolve_callback(spec: str):
    """The object a run.callbacks entry names; ConfigError naming the entry where it is not there."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"run.callbacks entry {spec!r}: give package.module:name, e.g. my_pkg.tracking:WandbLogger")
    try:
        target = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"run.callbacks entry {spec!r}: cannot import {module} ({err}); is its package "
                          "installed, or on PYTHONPATH?") from err
    for part in name.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"run.callbacks entry {spec!r}: {module} has no {name}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"run.callbacks entry {spec!r}: {name} is not a class or function")
    return target


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # What one micro-batch example runs, for launch.plan's memory and FLOPs; post-training's differ.
    def rows_per_example(self) -> int:
        """Rows of tokens an example runs with gradients."""
        return 1

    def tokens_per_row(self) -> int:
        return self.model.max_seq_len

    def holds_reference_model(self) -> bool:
        """Whether a frozen copy of the model is held beside it."""
        return False

    def to_dict(self) -> dict:
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value.to_dict() if name == "model" else dataclasses.asdict(value)
                for name, value in sections.items()}


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for before, item in zip([None, *overrides], overrides):
        if "=" not in item:
            split = before is not None and "=" in before and before.split("=", 1)[1].strip()[:1] in ("[", "{")
            key = before.split("=", 1)[0] if split else ""
            hint = (f"; the shell split the value of {key} at its spaces: quote the whole override, as "
                    f"'{key}=[a, b]'" if split else "")
            raise ConfigError(f"override {item!r} must look like section.key=value{hint}")
        dotted, raw = item.split("=", 1)
        node = tree
        *parents, leaf = dotted.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if raw.strip().startswith("["):  # a YAML list: [a, b] or [{shards: x, weight: 2}, ...]
            try:
                raw = yaml.safe_load(raw)
            except yaml.YAMLError:
                pass  # not a list: a string such as the path [exp]v1, checked as the key's value
        node[leaf] = raw
    return tree


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of a key given twice (a second `train:` section drops the first one's
    keys without a word): refused here instead."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"{self.name}: {key!r} is given twice (lines {seen[key]} and {line}); YAML would "
                                  "keep the second alone: merge them into one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: Path):
    """A config file's YAML, its mistakes (syntax, keys given twice) as ConfigErrors."""
    try:
        with open(path) as stream:  # the loader names the file in its messages
            return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                config_class: type[Config] = Config, known_sections_only: bool = False) -> Config:
    """Defaults, then the YAML file, then the overrides; model.plugins are imported first, so that
    the kinds and sections they register can be named. `config_class`: Config or a subclass with
    sections of its own (posttrain.config); `known_sections_only`: the file's other sections (one
    another entry point wrote) are left out instead of refused."""
    values = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        values = read_yaml(path) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (run, model, data, parallel, train, profile, eval)")
        if known_sections_only:
            sections = {f.name for f in dataclasses.fields(config_class)}
            values = {k: v for k, v in values.items() if k in sections}
    tree = parse_overrides(overrides or [])
    cfg = config_class()
    if "post" not in {f.name for f in dataclasses.fields(config_class)} and ("post" in values or "post" in tree):
        raise ConfigError("the post section sets post-training, which runs with python -m posttrain.train "
                          "(launch.local / launch.submit / launch.plan with --post)")
    for layer in (values, tree):  # the overrides' plug-ins win, as their other keys do
        model = layer.get("model")
        if isinstance(model, dict) and "plugins" in model:
            apply_values(cfg.model, {"plugins": model["plugins"]}, "model.")
    registry.load_plugins(cfg.model.plugins)
    apply_values(cfg, values)
    apply_values(cfg, tree)
    return cfg


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def validate(cfg: Config, world_size: int) -> None:
    """Every key, once, before anything expensive is built; raises ConfigError naming the key and the fix."""
    normalise(cfg)  # values set in code, not through load_config
    m, p, t = cfg.model, cfg.parallel, cfg.train
    # inf and nan pass every range check below (nan < 0 is false) and fail, or do nothing, later
    for key, value in _flat(cfg.to_dict()).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
    for spec in cfg.run.callbacks:
        resolve_callback(spec)
    taken = {source.name for source in cfg.data.sources}
    if clash := sorted(taken & {s.name for s in cfg.eval.val_sets}):
        raise ConfigError(f"eval.val_sets names {clash} as data.mix does (they name the val/ scalars): give the "
                          "validation sets other names")
    if p.tensor < 1 or p.expert < 1:
        raise ConfigError("parallel.tensor and parallel.expert must be >= 1")
    if world_size % p.tensor:
        raise LayoutError(
            f"world size {world_size} is not divisible by parallel.tensor={p.tensor}; "
            "launch a multiple of the tensor-parallel size processes"
        )
    dp = world_size // p.tensor
    if dp % p.expert:
        raise LayoutError(
            f"data-parallel size {dp} (world {world_size} / tensor {p.tensor}) is not divisible by "
            f"parallel.expert={p.expert}; set parallel.expert to a divisor of {dp} (e.g. "
            f"parallel.expert={math.gcd(dp, p.expert)}) or launch a multiple of {p.tensor * p.expert} processes"
        )
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: choose 0, 1, 2 or 3")
    registry.validate_model(m, registry.ParallelSizes(tensor=p.tensor, expert=p.expert))
    routed = any(registry.mlp_kind(m.mlp_kind(i)).routed for i in range(m.num_layers))
    if routed and p.zero_stage == 3:
        raise ConfigError(
            "parallel.zero_stage=3 does not support expert layers (DeepSpeed refuses MoE with ZeRO-3); "
            f"use parallel.zero_stage=1 or 2 for {m.mlp} models"
        )
    if p.expert > 1 and p.zero_stage == 0 and t.grad_clip > 0:
        raise ConfigError(
            f"parallel.zero_stage=0 with parallel.expert={p.expert} clips by a wrong norm (DeepSpeed "
            "averages the ranks' norms where their experts' should add up): use parallel.zero_stage=1 or "
            "2, or train.grad_clip=0")
    if not routed and p.expert != 1:
        experts = sorted(name for name, kind in registry.mlp_kinds().items() if kind.routed)
        raise ConfigError(f"parallel.expert > 1 needs an expert model: set model.mlp to one of {experts}")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision={t.precision!r}: choose auto, fp32 or bf16")
    for key in ("steps", "micro_batch", "grad_accum", "log_interval", "eval_interval", "save_interval", "keep_last"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 1")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0 "
                          "(0 = no warmup: the schedule starts at once)")
    for key, zero in (("stop_at_step", "run to train.steps"), ("eval_batches", "no validation"),
                      ("grad_clip", "no clipping"), ("weight_decay", "none"),
                      ("save_interval_minutes", "by steps only"), ("stop_after_minutes", "no time limit")):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0 (0 = {zero})")
    if t.keep_every < 0 or t.keep_every % t.save_interval:
        raise ConfigError(f"train.keep_every={t.keep_every} must be 0 (keep the last train.keep_last alone) or a "
                          f"multiple of train.save_interval={t.save_interval}, the steps that are saved")
    if t.stop_after_minutes > MAX_TIMER_MINUTES:
        raise ConfigError(f"train.stop_after_minutes={t.stop_after_minutes:g} is more than a timer holds "
                          f"({MAX_TIMER_MINUTES:g} minutes): give a run's time, or 0 for no limit")
    if t.stop_at_step > t.steps:
        raise ConfigError(f"train.stop_at_step={t.stop_at_step} is past train.steps={t.steps}, where the run ends "
                          "first: lower it, or raise train.steps")
    if t.lr < 0:
        raise ConfigError(f"train.lr={t.lr} must be >= 0 (the peak rate, e.g. 3e-4; 0 keeps the weights)")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        raise ConfigError(f"train.beta1={t.beta1} and train.beta2={t.beta2} must be in [0, 1) (e.g. 0.9 and 0.95)")
    if cfg.data.num_workers < 0 or cfg.data.num_canonical_nodes < 1:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0 and data.num_canonical_nodes="
                          f"{cfg.data.num_canonical_nodes} >= 1")
    if t.skip_spikes:
        if t.spike_sigmas <= 0 or t.spike_window < 20:
            raise ConfigError(f"train.spike_sigmas={t.spike_sigmas} must be > 0 and train.spike_window="
                              f"{t.spike_window} at least 20 (the steps judged before a spike can be found)")
        if cfg.parallel.zero_stage < 1:
            raise ConfigError("train.skip_spikes=true needs parallel.zero_stage >= 1: the check runs inside "
                              "DeepSpeed's ZeRO optimizer step, where the global gradient norm is known")
    if t.z_loss < 0:
        raise ConfigError(f"train.z_loss={t.z_loss} must be >= 0 (0 = off; 1e-4 is the usual coefficient)")
    if t.warmup_steps >= t.steps:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be smaller than train.steps={t.steps}")
    validate_schedule(t)
    validate_batch_ramp(t, world_size // p.tensor)
    if cfg.data.synthetic and cfg.eval.sample_prompts:
        raise ConfigError("eval.sample_prompts needs the run's tokenizer, which data.synthetic=true does without: "
                          "leave eval.sample_prompts out")
    _validate_eval(cfg.eval)
    _validate_profile(cfg.profile, t.steps, world_size)


# Keys read only while another key switches their feature on: (section, keys, switch, reads them).
SWITCHED_KEYS = (
    ("train", ("decay_shape", "decay_fraction"), "train.schedule=wsd", lambda c: c.train.schedule == "wsd"),
    ("train", ("spike_sigmas", "spike_window"), "train.skip_spikes=true", lambda c: c.train.skip_spikes),
    ("eval", ("downstream_tasks", "downstream_limit"), "eval.downstream_interval > 0",
     lambda c: c.eval.downstream_interval > 0),
    ("profile", ("steps", "ranks", "memory"), "profile.start_step > 0", lambda c: c.profile.start_step > 0),
    ("data", ("shards", "mix", "cache", "num_workers"), "data.synthetic=false", lambda c: not c.data.synthetic),
)


def inert_settings(cfg: Config) -> list[str]:
    """Keys set away from their defaults whose feature is off, so that they change nothing: one
    line each, for the run to print."""
    defaults, lines = type(cfg)(), []
    for section, keys, switch, reads in SWITCHED_KEYS:
        if reads(cfg):
            continue
        changed = [f"{section}.{key}={getattr(getattr(cfg, section), key)!r}" for key in keys
                   if getattr(getattr(cfg, section), key) != getattr(getattr(defaults, section), key)]
        if changed:
            one = len(changed) == 1
            lines.append(f"note: {', '.join(changed)} {'is' if one else 'are'} read with {switch} only: "
                         f"{'it changes' if one else 'they change'} nothing here")
    return lines


def parse_ranks(text: str) -> set[int] | None:
    """profile.ranks: "all" -> None (every rank); "0,8" or [0, 8] -> {0, 8}."""
    return index_set(parse_indices(text, "profile.ranks"))


def _validate_profile(prof: ProfileConfig, steps: int, world_size: int) -> None:
    if not prof.start_step:
        return
    if prof.start_step < 0 or prof.steps < 1:
        raise ConfigError(f"profile.start_step={prof.start_step} and profile.steps={prof.steps} must be >= 1 "
                          "(profile.start_step=0 turns profiling off)")
    if prof.start_step > steps:
        raise ConfigError(f"profile.start_step={prof.start_step} is after the last step (train.steps={steps})")
    ranks = parse_ranks(prof.ranks)
    if ranks is not None and max(ranks) >= world_size:
        raise ConfigError(f"profile.ranks={prof.ranks!r} names rank {max(ranks)}, but the world has "
                          f"{world_size} ranks (0-{world_size - 1})")


def _validate_eval(e: EvalConfig) -> None:
    if e.sample_tokens < 1 or not all(isinstance(p, str) and p for p in e.sample_prompts):
        raise ConfigError(f"eval.sample_prompts={e.sample_prompts} must be non-empty strings and eval.sample_tokens="
                          f"{e.sample_tokens} >= 1 (the new tokens of each sample)")
    if e.downstream_interval < 0 or e.downstream_limit < 0:
        raise ConfigError("eval.downstream_interval and eval.downstream_limit must be >= 0 (0 = off / all)")
    if e.downstream_interval and not e.downstream_tasks:
        raise ConfigError(f"eval.downstream_interval={e.downstream_interval} but eval.downstream_tasks is empty: "
                          "list task files (JSONL), e.g. eval.downstream_tasks=[tasks/hellaswag.jsonl]")
    missing = [p for p in e.downstream_tasks if not Path(p).is_file()]
    if e.downstream_interval and missing:
        raise ConfigError(f"eval.downstream_tasks: no such file {', '.join(missing)}")
    from pretrain.downstream import empty_task_error, task_name

    names = [task_name(p) for p in e.downstream_tasks]
    if len(set(names)) < len(names):
        raise ConfigError(f"eval.downstream_tasks={e.downstream_tasks}: tasks are logged by file name, and two "
                          "share one; give the files distinct names")
    if e.downstream_interval and (error := empty_task_error(e.downstream_tasks)):
        raise ConfigError(f"eval.downstream_tasks: {error}")


EMPTY_TOKENIZER = ("data.tokenizer is empty (the config of a model imported without --tokenizer names none): "
                   "set data.tokenizer to the tokenizer directory")


def read_manifest(path: Path, key: str) -> dict:
    """A shard build's manifest.json, or a ConfigError naming `key` where it is not one."""
    rebuild = "rebuild the shards with python -m data_prep.build_shards"
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{key}: {path} is not JSON ({err}); {rebuild}") from None
    missing = [k for k in ("seq_len", "vocab_size", "tokenizer_sha256")
               if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ConfigError(f"{key}: {path} is not a manifest data_prep.build_shards wrote (no {', '.join(missing)}); "
                          f"{rebuild}")
    return manifest


def missing_manifest_fix(path: Path) -> str:
    """What to do about a shards directory without manifest.json."""
    if (path / "plan.json").is_file():
        return ("it is an unfinished build (plan.json, no manifest yet): run its python -m data_prep.build_shards "
                "command again to finish it")
    if path.name in ("train", "val") and (path / "index.json").is_file():
        return f"it is one split of a build: give the build's directory, {path.parent}"
    return f"build shards with python -m data_prep.build_shards --out {path}"


def split_shards(root: Path, split: str, key: str, manifest: dict) -> list[dict]:
    """The shards the index of a local split lists ([] for a split the manifest says is empty, as
    val after --val-fraction 0), each file there: a ConfigError names a copy or build that lost some."""
    index = root / split / "index.json"
    if not index.is_file():
        if split == "val" and not manifest.get("splits", {}).get(split, {}).get("samples"):
            return []
        raise ConfigError(f"{key}: {split}/index.json is missing: the build is incomplete; run its python -m "
                          "data_prep.build_shards command again (or copy the directory again)")
    shards = json.loads(index.read_text())["shards"]
    missing = [name for shard in shards
               if not (root / split / (name := (shard.get("zip_data") or shard["raw_data"])["basename"])).is_file()]
    if missing:
        raise ConfigError(f"{key}: {len(missing)} of the {len(shards)} shard files {split}/index.json lists are "
                          f"missing (first: {split}/{missing[0]}): run its python -m data_prep.build_shards command "
                          "again with --overwrite (or copy the directory again)")
    return shards


def validate_data(cfg: Config, world_size: int | None = None) -> dict:
    """Match the model against every source's manifest and the tokenizer, and (given the world size)
    the train split against one micro-batch per data-parallel rank, before training starts.
    Returns the first local source's manifest ({} when all are remote)."""
    encodes = "the downstream tasks" if cfg.eval.downstream_tasks else "eval.sample_prompts"
    if not cfg.data.tokenizer and (cfg.eval.downstream_tasks or cfg.eval.sample_prompts):  # remote shards need none
        raise ConfigError(f"{EMPTY_TOKENIZER} {encodes} are encoded with")
    if cfg.eval.sample_prompts and not (Path(cfg.data.tokenizer) / MODEL_FILE).is_file():
        raise ConfigError(f"eval.sample_prompts are encoded with the SentencePiece model of data.tokenizer="
                          f"{cfg.data.tokenizer}, and {MODEL_FILE} is not there: point it at the tokenizer directory")
    tokenizer_meta = Path(cfg.data.tokenizer) / "tokenizer.json"
    manifests, tokenizer, train_samples = [], None, 0
    if cfg.data.synthetic and (cfg.data.document_mask or cfg.data.start_with_bos):
        raise ConfigError("data.synthetic=true: random tokens hold no documents and no BOS; set "
                          "data.document_mask=false and data.start_with_bos=false")

    def checked_manifest(source: DataSource, key: str) -> dict:
        """A local shard set's manifest, matched against the model and the tokenizer."""
        nonlocal tokenizer
        manifest_path = Path(source.shards) / "manifest.json"
        if not manifest_path.is_file():
            raise ConfigError(f"{key}: no manifest.json there; {missing_manifest_fix(Path(source.shards))}")
        manifest = read_manifest(manifest_path, key)
        if manifest["seq_len"] != cfg.model.max_seq_len:
            raise ConfigError(
                f"model.max_seq_len={cfg.model.max_seq_len} but the shards of {key} hold sequences of "
                f"{manifest['seq_len']}; set model.max_seq_len={manifest['seq_len']} or rebuild the shards"
            )
        if manifest["vocab_size"] != cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} but the tokenizer of {key} has "
                f"{manifest['vocab_size']} tokens; set model.vocab_size={manifest['vocab_size']}"
            )
        if tokenizer is None:  # read once, when the first source needs it
            if not cfg.data.tokenizer:
                raise ConfigError(f"{EMPTY_TOKENIZER} the shards of {key} were built with")
            if not tokenizer_meta.is_file():
                raise ConfigError(
                    f"data.tokenizer={cfg.data.tokenizer}: no tokenizer.json there; train one with "
                    f"python -m data_prep.train_tokenizer --out {cfg.data.tokenizer}"
                )
            try:
                tokenizer = tokenizer_record(cfg.data.tokenizer)
            except (OSError, ValueError) as err:
                raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: {err}") from None
        if tokenizer["sha256"] != manifest["tokenizer_sha256"]:
            raise ConfigError(
                f"the shards of {key} were built with a different tokenizer than {cfg.data.tokenizer}; "
                "point data.tokenizer at the one used for the shards, or rebuild them"
            )
        if cfg.data.document_mask and manifest.get("eos_id") is None:
            raise ConfigError(f"data.document_mask=true needs the EOS id, which the manifest of {key} does not "
                              "record: rebuild the shards with python -m data_prep.build_shards, or set "
                              "data.document_mask=false")
        if cfg.data.start_with_bos and manifest.get("bos_id", -1) in (None, -1):
            raise ConfigError(f"data.start_with_bos=true needs the BOS id, which the manifest of {key} does "
                              "not record (or the tokenizer has none): rebuild the shards with python -m "
                              "data_prep.build_shards and a tokenizer with BOS, or set "
                              "data.start_with_bos=false")
        return manifest

    for source in [] if cfg.data.synthetic else cfg.data.sources:
        if "://" in source.shards:
            continue
        key = (f"data.mix entry {source.name!r} (shards={source.shards})" if source.name
               else f"data.shards={source.shards}")
        manifest = checked_manifest(source, key)
        manifests.append(manifest)
        train_samples += sum(shard["samples"] for shard in split_shards(Path(source.shards), "train", key, manifest))
        split_shards(Path(source.shards), "val", key, manifest)
    for source in cfg.eval.val_sets:
        if "://" not in source.shards:
            key = f"eval.val_sets entry {source.name!r} (shards={source.shards})"
            manifest = checked_manifest(source, key)
            if not (split_shards(Path(source.shards), "val", key, manifest)
                    or split_shards(Path(source.shards), "train", key, manifest)):
                raise ConfigError(f"{key}: holds no samples")
    if world_size and manifests and len(manifests) == len(cfg.data.sources):
        # Streaming gives each data-parallel rank ceil(samples / ranks) of an epoch; the loader drops
        # a last partial micro-batch, so fewer than one micro-batch each would give no batch at all.
        ranks = world_size // cfg.parallel.tensor
        if -(-train_samples // ranks) < cfg.train.micro_batch:
            raise ConfigError(f"the train split holds {train_samples} samples, fewer than train.micro_batch="
                              f"{cfg.train.micro_batch} for each of the {ranks} data-parallel ranks: lower "
                              "train.micro_batch (or the ranks), or build more data")
    if cfg.data.synthetic:
        return {}
    if cfg.data.start_with_bos and not manifests:
        raise ConfigError("data.start_with_bos=true needs the BOS id from a local manifest.json, but every "
                          "data source is remote: set data.start_with_bos=false")
    if cfg.data.document_mask and not manifests:
        raise ConfigError("data.document_mask=true needs the EOS id from a local manifest.json, but every data "
                          "source is remote: set data.document_mask=false")
    return manifests[0] if manifests else {}
