"""Learning-rate schedules, as a multiplier of train.lr for every step. `train.schedule`:

  cosine  linear warmup over warmup_steps, then cosine decay to min_lr_ratio at train.steps
  wsd     warmup-stable-decay: linear warmup, the full rate, then a decay to min_lr_ratio over the
          last decay_fraction of train.steps (decay_shape linear, or sqrt: 1 - sqrt(progress)).
          Until the decay starts the rate does not depend on train.steps, so a run can be extended
          by resuming it with a larger train.steps.

Warmup step k (1-based) runs at k / warmup_steps of the rate: the first step already learns, and
none runs above the schedule. A resumed run restores the step count from the checkpoint and takes
the shape (train.lr, train.steps, ...) from its config.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch.optim.lr_scheduler import LambdaLR

from models.config import ConfigError

if TYPE_CHECKING:
    from pretrain.config import TrainConfig

SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "sqrt")


def decay_steps(t: TrainConfig) -> int:
    """Steps over which the rate falls to min_lr_ratio."""
    if t.schedule == "wsd":
        return max(1, round(t.decay_fraction * t.steps))
    return t.steps - t.warmup_steps


def validate_schedule(t: TrainConfig) -> None:
    """The schedule keys of train.*; raises ConfigError naming the key and the fix."""
    if t.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule={t.schedule!r}: choose one of {SCHEDULES}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    # checked with any schedule: a misspelt value would stay unseen until the schedule changed
    if t.decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"train.decay_shape={t.decay_shape!r}: choose one of {DECAY_SHAPES}")
    if not 0 < t.decay_fraction <= 1:
        raise ConfigError(f"train.decay_fraction={t.decay_fraction} must be in (0, 1]")
    if t.schedule != "wsd":
        return
    if t.warmup_steps + decay_steps(t) > t.steps:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} plus the {decay_steps(t)} decay steps (train.decay_fraction="
            f"{t.decay_fraction} of train.steps={t.steps}) exceed train.steps; shorten one of them"
        )


def lr_multiplier(index: int, t: TrainConfig) -> float:
    """The rate of step index + 1 (0-based, as torch schedulers count) over train.lr."""
    if index < t.warmup_steps:
        return (index + 1) / t.warmup_steps
    start = t.steps - decay_steps(t)
    if index < start:
        return 1.0
    progress = min(1.0, (index - start + 1) / decay_steps(t))
    if t.schedule == "cosine":
        remaining = (1.0 + math.cos(math.pi * progress)) / 2
    else:
        remaining = 1.0 - (math.sqrt(progress) if t.decay_shape == "sqrt" else progress)
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * remaining


class LRSchedule(LambdaLR):
    """torch's LambdaLR over lr_multiplier. The multiplier is a plain function, which LambdaLR's
    state_dict leaves out, and so is the config: a checkpoint holds the step count, the config the
    shape."""

    def __init__(self, optimizer, t: TrainConfig):
        self.train_config = t

        def multiplier(index: int) -> float:
            return lr_multiplier(index, t)

        super().__init__(optimizer, multiplier)

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "train_config"}

    def load_state_dict(self, state: dict) -> None:
        if "last_batch_iteration" in state:  # DeepSpeed's WarmupCosineLR, which older checkpoints hold
            self.last_epoch = state["last_batch_iteration"] + 1  # it counts from -1, LambdaLR from 0
            return
        super().load_state_dict(state)

    def follow_config(self) -> None:
        """After a checkpoint load: the next step's rate from this config (its train.lr and
        train.steps) at the restored position, not the rate the optimizer state was saved with."""
        t = self.train_config
        self.base_lrs = [t.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * lr_multiplier(self.last_epoch, t)


def client_scheduler(t: TrainConfig):
    """deepspeed.initialize's lr_scheduler: builds the schedule on DeepSpeed's optimizer."""
    return lambda optimizer: LRSchedule(optimizer, t)

