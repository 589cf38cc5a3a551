"""Loss-spike protection (train.skip_spikes): an optimizer step whose loss or gradient norm is more
than train.spike_sigmas standard deviations above the mean of the last train.spike_window accepted
steps is skipped: no parameter or optimizer-state update (nor of routed layers' selection bias:
GPT.after_optimizer_step), while the batch is consumed and the learning-rate schedule moves on as
for any step.

A non-finite gradient norm is always skipped (a non-finite loss with it: the run goes on, up to
MAX_NONFINITE_IN_ROW in a row). After MAX_CONSECUTIVE_SKIPS skips in a row the level has moved for
good and the window starts over. The loss is the data-parallel mean and the gradient
norm the global one, so every rank decides the same. The decision is taken inside DeepSpeed's optimizer step, after it has computed the global
gradient norm and before it calls the torch optimizer, which is a SkipStepAdamW: it returns without
touching parameters or moments when the guard says so. The window is part of each rank's checkpoint
state, so a resumed run skips exactly the steps the uninterrupted one skips.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import torch

MIN_STEPS = 20  # accepted steps in the window before anything is judged a spike
# After this many skips in a row the loss has moved for good (a new data mix, a resume on other data):
# the window starts over instead of skipping every step from now on.
MAX_CONSECUTIVE_SKIPS = 10
# Non-finite losses in a row (each update skipped) that stop the run: one bad batch is skipped, a
# model that gives nothing finite any more is broken.
MAX_NONFINITE_IN_ROW = 10


class SpikeGuard:
    def __init__(self, window: int, sigmas: float):
        self.window, self.sigmas = window, sigmas
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.skipped_steps: list[int] = []
        self.consecutive = 0  # skips in a row
        self.nonfinite = 0  # non-finite losses in a row
        self.restarted = False  # the step in progress restarted the window
        self._loss: float | None = None
        self._grad_norm = 0.0
        self.decision: tuple[bool, str] | None = None  # of the step in progress, once taken

    def _limit(self, values: deque[float]) -> float:
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return mean + self.sigmas * std

    def begin_step(self, loss: float) -> None:
        """Before the optimizer step: this step's (data-parallel mean) loss."""
        self._loss, self.decision = loss, None

    def skip(self, grad_norm: float) -> bool:
        """Called by the optimizer, possibly once per parameter group: the first call decides."""
        if self.decision is None:
            reason = ""
            if not math.isfinite(grad_norm):
                reason = f"grad norm {grad_norm}"
            elif self._loss is not None and len(self.losses) >= MIN_STEPS:
                if self._loss > (limit := self._limit(self.losses)):
                    reason = f"loss {self._loss:.4f} > {limit:.4f}"
                elif grad_norm > (limit := self._limit(self.grad_norms)):
                    reason = f"grad norm {grad_norm:.4f} > {limit:.4f}"
            self.restarted = bool(reason) and self.consecutive >= MAX_CONSECUTIVE_SKIPS and math.isfinite(grad_norm)
            if self.restarted:  # applied, and the window refills from here
                self.losses.clear()
                self.grad_norms.clear()
                reason = ""
            self.decision = (bool(reason), reason)
            self._grad_norm = grad_norm
        return self.decision[0]

    def refused(self, grad_norm: float) -> None:
        """The step's update was refused before the guard was asked (DeepSpeed's BF16_Optimizer returns
        at a non-finite norm): a skip like any other."""
        if self.decision is None:
            self.decision, self._grad_norm = (True, f"grad norm {grad_norm}"), grad_norm

    def end_step(self, step: int) -> str:
        """After the optimizer step: the reason the step was skipped ('' when it was applied)."""
        skipped, reason = self.decision if self.decision is not None else (False, "")
        self.nonfinite = self.nonfinite + 1 if self._loss is not None and not math.isfinite(self._loss) else 0
        if skipped:
            self.skipped_steps.append(step)
            self.consecutive += 1
        else:
            self.consecutive = 0
            if self.decision is not None and self._loss is not None and math.isfinite(self._loss):
                self.losses.append(self._loss)
                self.grad_norms.append(self._grad_norm)
        self._loss, self.decision = None, None
        return reason

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "skipped_steps": list(self.skipped_steps), "consecutive": self.consecutive,
                "nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.window)
        self.grad_norms = deque(state["grad_norms"], maxlen=self.window)
        self.skipped_steps = list(state["skipped_steps"])
        self.consecutive = state.get("consecutive", 0)
        self.nonfinite = state.get("nonfinite", 0)


class SkipStepAdamW(torch.optim.AdamW):
    """torch's AdamW whose step does nothing while ``should_skip()`` says so (``skipped`` tells
    whether the last step did)."""

    should_skip: Callable[[], bool] = staticmethod(lambda: False)
    skipped = False

    @torch.no_grad()
    def step(self, closure=None):
        self.skipped = self.should_skip()
        if self.skipped:
            return None
        return super().step(closure)
