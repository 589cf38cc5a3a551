"""README stays in step with the code: every config key is documented, and every module, path and
command-line flag it names exists."""

import argparse
import dataclasses
import importlib.util
import itertools
import re
import runpy
from pathlib import Path
from unittest import mock

import pytest

from models import registry
from posttrain.config import PostTrainConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PROJECT_DIRS = ("configs", "bench", "tools", "models", "pretrain", "posttrain", "launch", "data_prep", "tests",
                "slurm")


def config_keys(prefix: str, config: type) -> list[str]:
    """Dotted keys of every leaf field of a config dataclass."""
    keys = []
    for field in dataclasses.fields(config):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            keys += config_keys(f"{prefix}{field.name}.", type(default))
        else:
            keys.append(prefix + field.name)
    return keys


def all_config_keys() -> list[str]:
    registry.load_builtins()
    keys = config_keys("", PostTrainConfig)  # pretraining's sections and post.*
    for name, section in registry._sections.items():
        if section.config.__module__.startswith(registry.BUILTIN_PACKAGES):  # not test plug-ins loaded before
            keys += config_keys(f"model.{name}.", section.config)
    return keys


def documented(key: str) -> bool:
    """The whole dotted key named, or its name as code (`name`, in a section's table or text)."""
    name = key.rsplit(".", 1)[-1]
    return re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])|`{re.escape(name)}`", README) is not None


def test_every_config_key_is_documented():
    keys = all_config_keys()
    assert len(keys) > 100 and "model.lisa.keep_chain_scores" in keys and "post.beta" in keys
    missing = [key for key in keys if not documented(key)]
    assert not missing, f"config keys README never names (document them under their section): {missing}"


def section_default_rows() -> list[tuple[list[str], list[str]]]:
    """(keys, defaults) of the key table's rows for the model sections of the built-in kinds."""
    rows = []
    for line in README.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and re.match(r"`model\.(relu_attention|lisa|moe)\.", cells[0]):
            keys = [k.strip("` ") for k in cells[0].split(",")]
            section = keys[0].split(".")[1]
            rows.append(([k if "." in k else f"model.{section}.{k}" for k in keys],
                         [d.strip("` ") for d in cells[1].split(",")]))
    return rows


def test_the_model_sections_defaults_are_the_code_s():
    """The key table states each section key's default as its dataclass does."""
    rows = section_default_rows()
    assert {keys[0].split(".")[1] for keys, _ in rows} == {"relu_attention", "lisa", "moe"}
    sections = registry.sections()
    for keys, defaults in rows:
        assert len(keys) == len(defaults), keys
        for key, stated in zip(keys, defaults):
            _, section, name = key.split(".")
            default = {f.name: f.default for f in dataclasses.fields(sections[section].config)}[name]
            written = str(default).lower() if isinstance(default, bool) else str(default)
            assert stated == written or (isinstance(default, float) and float(stated) == default), (key, stated, default)
    listed = {key for keys, _ in rows for key in keys}
    assert listed == {f"model.{name}.{f.name}" for name in ("relu_attention", "lisa", "moe")
                      for f in dataclasses.fields(sections[name].config)}


def test_key_check_fails_on_an_undocumented_name():
    assert documented("model.lisa.keep_chain_scores") and documented("model.lisa.align_group")
    assert not documented("model.lisa.keep_chain") and not documented("train.no_such_key")  # whole names only


# `python -m NAME`, NAME whole (not the placeholder in `python -m tools.<name>`)
RUN_MODULE = r"python -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![.\w<])"


def runnable(module: str) -> Path | None:
    """The file `python -m module` runs, or None."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin)
    if spec.submodule_search_locations:
        path = path.parent / "__main__.py"
    return path if path.is_file() else None


class _Parsing(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def defined_flags(module: str) -> set[str]:
    """The option strings of the parser `python -m module` parses its arguments with (caught as it
    parses, before it does anything), its subcommands' too."""
    def caught(parser, *args, **kwargs):
        raise _Parsing(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught):
        try:
            runpy.run_module(module, run_name="__main__")
        except _Parsing as parsing:
            parser = parsing.parser
        else:
            raise AssertionError(f"python -m {module} parsed no arguments")
    flags = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            flags.update(*(sub._option_string_actions for sub in action.choices.values()))
    return flags


def test_every_module_readme_runs_exists():
    modules = sorted(set(re.findall(RUN_MODULE, README)))
    assert len(modules) > 20 and "bench.lisa_decode" in modules
    missing = [m for m in modules if runnable(m) is None]
    assert not missing, f"README runs `python -m` on modules that do not exist: {missing}"


def test_every_flag_readme_passes_is_defined():
    unknown = []
    for line in re.sub(r"\\\n\s*", " ", README).splitlines():  # a command's continuation lines joined
        match = re.search(RUN_MODULE + "(.*)", line)
        if not match or runnable(match.group(1)) is None:
            continue
        flags = defined_flags(match.group(1))
        for flag in re.findall(r"(?<![\w=-])(--[a-z][\w-]*)", match.group(2)):  # not --sbatch-arg=--mem
            if flag not in flags:
                unknown.append(f"{match.group(1)} {flag}")
    assert not unknown, f"README passes flags its commands do not define: {sorted(set(unknown))}"


def expand_braces(path: str) -> list[str]:
    """configs/dense_{125m,1b}.yaml -> configs/dense_125m.yaml, configs/dense_1b.yaml"""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_path_readme_names_exists():
    pattern = r"(?<![\w/.{-])((?:%s)/[\w./{},*-]*[\w}*])" % "|".join(PROJECT_DIRS)
    paths = sorted({p for raw in re.findall(pattern, README) for p in expand_braces(raw)})
    assert "configs/hybrid_1b.yaml" in paths
    missing = [p for p in paths if not any(REPO.glob(p))]
    assert not missing, f"README names files that do not exist: {missing}"


@pytest.mark.parametrize("path, expanded", [
    ("configs/dense_{125m,1b}.yaml", ["configs/dense_125m.yaml", "configs/dense_1b.yaml"]),
    ("bench/gpu_run.sh", ["bench/gpu_run.sh"]),
])
def test_expand_braces(path, expanded):
    assert expand_braces(path) == expanded


def test_the_uoe_reading_s_t_test_is_the_benchmark_s():
    """README quotes Welch's p for dense and MoE + shared against UoE; bench.trainer_runs.welch_p on
    the committed runs gives them (and nothing for a single seed, which has no spread to test)."""
    import json

    from bench.trainer_runs import over_seeds, welch_p

    runs = json.loads((REPO / "bench/results/uoe_vs_moe.json").read_text())["runs"]
    losses = {name: over_seeds([r["val_loss"] for r in runs[name]]) for name in ("dense", "moe+shared", "uoe")}
    quoted = re.search(r"Welch's t-test\s+on the three seeds p = ([\d.]+), MoE \+ shared ([\d.]+)", README)
    assert quoted, "README's UoE reading no longer quotes the t-test"
    assert f"{welch_p(losses['dense'], losses['uoe']):.2f}" == quoted.group(1)
    assert f"{welch_p(losses['moe+shared'], losses['uoe']):.2f}" == quoted.group(2)
    assert welch_p(over_seeds([4.0]), losses["uoe"]) is None
