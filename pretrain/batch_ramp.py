"""Batch-size ramp (train.batch_ramp_start, train.batch_ramp_steps), as Megatron-LM's
--rampup-batch-size and GPT-3's schedule: the global batch starts at batch_ramp_start samples and
grows linearly over batch_ramp_steps optimizer steps to the full one (micro_batch x grad_accum x
data-parallel size), in whole micro-batches per data-parallel rank (at least one).

Only the number of micro-batches a step accumulates changes: the micro-batch, the learning-rate
schedule (by steps) and the sample order stay as they are, so a resumed run, which counts samples,
continues the ramp exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.config import ConfigError

if TYPE_CHECKING:
    from pretrain.config import TrainConfig


def micro_batches_at(step: int, t: TrainConfig, data_parallel: int) -> int:
    """Micro-batches each data-parallel rank accumulates in optimizer step `step` (1-based)."""
    if not t.batch_ramp_start or step > t.batch_ramp_steps:
        return t.grad_accum
    round_samples = t.micro_batch * data_parallel  # one micro-batch on every rank
    full = t.grad_accum * round_samples
    samples = t.batch_ramp_start + (full - t.batch_ramp_start) * (step - 1) / t.batch_ramp_steps
    return max(1, min(t.grad_accum, int(samples // round_samples)))


def validate_batch_ramp(t: TrainConfig, data_parallel: int) -> None:
    """The ramp keys of train.*; raises ConfigError naming the key and the fix."""
    if t.batch_ramp_start < 0 or t.batch_ramp_steps < 0:
        raise ConfigError(f"train.batch_ramp_start={t.batch_ramp_start} and train.batch_ramp_steps="
                          f"{t.batch_ramp_steps} must be >= 0 (0: no ramp)")
    if not t.batch_ramp_start:
        if t.batch_ramp_steps:
            raise ConfigError(f"train.batch_ramp_steps={t.batch_ramp_steps} ramps from train.batch_ramp_start, "
                              "which is 0: give the global batch (samples) of the first step")
        return
    if t.grad_accum < 2:
        raise ConfigError(f"train.batch_ramp_start={t.batch_ramp_start}: a ramp grows the micro-batches a step "
                          "accumulates, up to train.grad_accum, which is 1: raise train.grad_accum (and lower "
                          "train.micro_batch to keep the global batch)")
    # Below one micro-batch per rank it rounds up to one: a run resumed on more ranks keeps its config
    full = t.grad_accum * t.micro_batch * data_parallel
    if t.batch_ramp_start >= full:
        raise ConfigError(
            f"train.batch_ramp_start={t.batch_ramp_start} must be below the global batch it ramps to "
            f"({t.micro_batch} x train.grad_accum={t.grad_accum} x {data_parallel} = {full})")
    if not 1 <= t.batch_ramp_steps <= t.steps:
        raise ConfigError(f"train.batch_ramp_steps={t.batch_ramp_steps} must be in [1, train.steps={t.steps}]: "
                          "the steps over which the global batch grows")
