"""The training entry points the launchers start: pretraining, or post-training (--post)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EntryPoint:
    module: str  # run as python -m MODULE --config CONFIG overrides...
    config_class: type
    # (config, world size) -> None: every check the job makes before it starts (config, data,
    # tokenizer, the checkpoint to resume or start from); raises ConfigError or CheckpointError.
    check: Callable
    paths: tuple[tuple[str, str], ...]  # (section, key) of the path settings made absolute for Slurm


def _check_pretrain(cfg, world_size: int) -> None:
    from pretrain.train import Task, prepare

    prepare(cfg, world_size, Task())


def _check_posttrain(cfg, world_size: int) -> None:
    from posttrain.train import PostTrainTask
    from pretrain.train import prepare

    prepare(cfg, world_size, PostTrainTask())


def entry_point(post: bool) -> EntryPoint:
    from pretrain.config import Config

    data = (("run", "dir"), ("data", "shards"), ("data", "tokenizer"), ("data", "cache"), ("train", "init_from"),
            ("eval", "downstream_tasks"))
    if not post:
        return EntryPoint("pretrain.train", Config, _check_pretrain, data)
    from posttrain.config import PostTrainConfig

    return EntryPoint("posttrain.train", PostTrainConfig, _check_posttrain,
                      data + (("post", "data"), ("post", "val_data")))
