"""Unsafe-ticket pruning: find and zero the weights that carry an unwanted behaviour, without
gradients, by contrasting the attribution of unsafe and safe responses (posttrain.attribution).

Each step re-attributes the current (masked) model on the calibration sets and ranks the unpruned
weights of every target:
    ratio   S_unsafe / (S_safe + eps)                       S_D = |W_ij| x rms_j over the set D
    zscore  z(S_unsafe) - z(S_safe), z over the layer's weights
    wanda   S_unsafe alone (no safe contrast; a baseline), ranked within each output row (Wei et al.)
    random  (one-shot only) weights drawn uniformly (a baseline)
among the `pool` fraction of each layer's weights with the highest S_unsafe. The next
`step_ratio` of all prunable weights, best first, is pruned (no layer beyond `layer_cap` of its
weights). A step is kept when it raises the cross-entropy of held-out unsafe responses and lowers
the objective, log CE_safe - log CE_unsafe (or CE_safe - CE_unsafe), with CE_safe and the utility
cross-entropy within their budgets (relative to the unpruned model). Beam search keeps the `beam_width` best states, each expanded into
`branches` candidates: the first, second, ... `step_ratio` slices of its ranking.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain import losses
from posttrain.attribution import InputNorms

METHODS = ("ratio", "zscore", "wanda")
ONE_SHOT_METHODS = METHODS + ("random",)
EPS = 1e-8


@dataclass
class SearchConfig:
    method: str = "ratio"
    pool: float = 0.1  # share of each layer's weights (highest unsafe attribution) that may be ranked
    step_ratio: float = 0.005  # share of all prunable weights pruned per step
    layer_cap: float = 0.2  # most of a layer's weights that may be pruned in total
    steps: int = 20
    beam_width: int = 1  # 1 with branches=1: greedy
    branches: int = 1
    safe_budget: float = 0.02  # CE_safe may rise by this share of the unpruned model's
    utility_budget: float = 0.02  # and the utility CE by this share
    target_unsafe_rate: float = 0.0  # stop once the measured unsafe rate is at or below it (needs a labeller)
    # What a step must lower: log_ratio = log CE_safe - log CE_unsafe (scale-free: the unsafe answers a model
    # has learned by heart can have a CE 20x below varied safe text's), or difference = CE_safe - CE_unsafe.
    objective: str = "log_ratio"


@dataclass
class State:
    masks: dict[str, torch.Tensor]  # target name -> bool [out, in], True = pruned
    scores: dict[str, float] = field(default_factory=dict)  # ce_safe, ce_unsafe, utility, objective

    def pruned(self) -> int:
        return sum(int(m.sum()) for m in self.masks.values())


def weight_scores(weight: torch.Tensor, rms_unsafe: torch.Tensor, rms_safe: torch.Tensor, method: str,
                  pool: float, pruned: torch.Tensor) -> torch.Tensor:
    """[out, in] ranking scores (float64), -inf outside the pool and on pruned weights.

    `ratio` is nearly one value per input column (|W_ij| cancels): within a column the larger
    |W_ij| ranks first through the EPS in the denominator, an order float32 would leave to rounding."""
    magnitude = weight.detach().abs().double()
    unsafe = magnitude * rms_unsafe.double()[None, :]
    safe = magnitude * rms_safe.double()[None, :]
    if method == "ratio":
        score = unsafe / (safe + EPS)
    elif method == "zscore":
        score = (unsafe - unsafe.mean()) / (unsafe.std() + EPS) - (safe - safe.mean()) / (safe.std() + EPS)
    elif method == "wanda":  # Wei et al.'s row-wise selection: each output row gives the same share
        score = (unsafe.argsort(dim=1).argsort(dim=1).float() + 1) / unsafe.shape[1]
    else:
        raise ValueError(f"unknown pruning method {method!r}: choose one of {', '.join(METHODS)}")
    # The pool: the highest-unsafe share of the weights not yet pruned.
    open_scores = unsafe.masked_fill(pruned, -math.inf).flatten()
    keep = max(1, int(pool * int((~pruned).sum())))
    threshold = open_scores.topk(keep).values[-1]
    score[(open_scores.view_as(unsafe) < threshold) | pruned] = -math.inf
    return score


def select(scores: dict[str, torch.Tensor], masks: dict[str, torch.Tensor], count: int, skip: int,
           layer_cap: float) -> dict[str, torch.Tensor]:
    """New masks: the ranked weights `skip` .. `skip + count` (over all layers, best first) pruned
    on top of `masks`, none beyond `layer_cap` of a layer's weights."""
    names, values, flat_ids = [], [], []
    for name, score in scores.items():
        room = int(layer_cap * score.numel()) - int(masks[name].sum())
        take = min(room, skip + count, int(torch.isfinite(score).sum()))
        if take <= 0:
            continue
        top = score.flatten().topk(take)
        names += [name] * take
        values.append(top.values)
        flat_ids.append(top.indices)
    new = {name: mask.clone() for name, mask in masks.items()}
    if not values:
        return new
    values, flat_ids = torch.cat(values), torch.cat(flat_ids)
    order = values.argsort(descending=True, stable=True)[skip:skip + count]
    for i in order.tolist():
        new[names[i]].view(-1)[flat_ids[i]] = True
    return new


@torch.no_grad()
def response_cross_entropy(model, batches: list) -> float:
    """Mean NLL per response token over `batches` (posttrain.batches rows; a batch's optional
    "documents" [batch, seq] ids keep attention within documents, as a run with data.document_mask)."""
    total, count = 0.0, 0.0
    for batch in batches:
        ctx = {"document_ids": batch["documents"]} if batch.get("documents") is not None else None
        logp = losses.token_logprobs(model.logits(batch["tokens"][:, :-1], ctx), batch["tokens"][:, 1:])
        trained = batch["trained"][:, 1:].float()
        total += float(-(logp * trained).sum())
        count += float(trained.sum())
    return total / max(count, 1.0)


class Pruner:
    """The model under pruning with its data: calibration and held-out batches of unsafe and safe
    responses and utility batches (posttrain.batches rows), all lists of batch dicts."""

    def __init__(self, model, calibration: dict[str, list], heldout: dict[str, list], utility: list,
                 config: SearchConfig, measure_unsafe: Callable[[], float] | None = None, log=print):
        self.model, self.config, self.log = model, config, log
        self.calibration, self.heldout, self.utility = calibration, heldout, utility
        self.measure_unsafe = measure_unsafe
        self.norms = InputNorms(model)
        self.originals = {t.name: t.weight.detach().clone() for t in self.norms.targets}
        self.weights = {t.name: t.weight for t in self.norms.targets}
        self.total = sum(w.numel() for w in self.originals.values())

    @torch.no_grad()
    def apply(self, state: State) -> None:
        for name, weight in self.weights.items():
            weight.copy_(self.originals[name].masked_fill(state.masks[name], 0.0))

    def cross_entropy(self, batches: list) -> float:
        return response_cross_entropy(self.model, batches)

    def score_state(self, state: State) -> State:
        self.apply(state)
        ce_safe, ce_unsafe = self.cross_entropy(self.heldout["safe"]), self.cross_entropy(self.heldout["unsafe"])
        utility = self.cross_entropy(self.utility) if self.utility else ce_safe
        if self.config.objective == "difference":
            objective = ce_safe - ce_unsafe
        else:
            objective = math.log(max(ce_safe, EPS)) - math.log(max(ce_unsafe, EPS))
        state.scores = {"ce_safe": ce_safe, "ce_unsafe": ce_unsafe, "utility": utility,
                        "objective": objective, "sparsity": state.pruned() / self.total}
        return state

    def ranking(self, state: State) -> dict[str, torch.Tensor]:
        self.apply(state)
        unsafe = self.norms.collect(self.model, self.calibration["unsafe"])
        safe = self.norms.collect(self.model, self.calibration["safe"])
        return {name: weight_scores(self.originals[name], unsafe[name], safe[name], self.config.method,
                                    self.config.pool, state.masks[name]) for name in unsafe}

    def acceptable(self, child: State, parent: State, base: State) -> bool:
        c, p, b = child.scores, parent.scores, base.scores
        return (c["ce_unsafe"] > p["ce_unsafe"] and c["objective"] < p["objective"]
                and c["ce_safe"] <= b["ce_safe"] * (1 + self.config.safe_budget)
                and c["utility"] <= b["utility"] * (1 + self.config.utility_budget))

    def _record(self, history: list, step: int, state: State, started: float) -> float | None:
        rate = self.measure_unsafe() if self.measure_unsafe is not None else None
        history.append({"step": step, **state.scores, "pruned": state.pruned(), "unsafe_rate": rate,
                        "seconds": time.perf_counter() - started})
        self.log(f"step {step}: {self._describe(state)}" + (f" | unsafe rate {rate:.3f}" if rate is not None else ""))
        return rate

    @staticmethod
    def _describe(state: State) -> str:
        s = state.scores
        return (f"sparsity {100 * s['sparsity']:.2f}% | CE unsafe {s['ce_unsafe']:.4f} safe {s['ce_safe']:.4f} "
                f"utility {s['utility']:.4f}")

    def _done(self, rate: float | None) -> bool:
        done = rate is not None and rate <= self.config.target_unsafe_rate
        if done:
            self.log(f"the unsafe rate {rate:.3f} is at or below the target {self.config.target_unsafe_rate}: "
                     "the search stops here")
        return done

    def empty(self) -> State:
        return State({name: torch.zeros_like(w, dtype=torch.bool) for name, w in self.originals.items()})

    def greedy(self) -> tuple[State, list[dict]]:
        """Prune the best-ranked slice each step while the step is acceptable."""
        started = time.perf_counter()
        base = self.score_state(self.empty())
        history: list[dict] = []
        state = base
        if self._done(self._record(history, 0, base, started)):
            return state, history
        count = max(1, int(self.config.step_ratio * self.total))
        for step in range(1, self.config.steps + 1):
            child = self.score_state(State(select(self.ranking(state), state.masks, count, 0, self.config.layer_cap)))
            if child.pruned() == state.pruned() or not self.acceptable(child, state, base):
                self.log(f"step {step} not kept: {self._describe(child)}; stopping")
                break
            state = child
            if self._done(self._record(history, step, state, started)):
                break
        self.apply(state)
        return state, history

    def beam(self) -> tuple[State, list[dict]]:
        """Keep the beam_width best acceptable states; each step expands every one into `branches`
        candidates (its ranking's first, second, ... slice). Returns the best state any step found."""
        started = time.perf_counter()
        base = self.score_state(self.empty())
        history: list[dict] = []
        if self._done(self._record(history, 0, base, started)):
            return base, history
        count = max(1, int(self.config.step_ratio * self.total))
        beams, best = [base], base
        for step in range(1, self.config.steps + 1):
            children = []
            for parent in beams:
                ranking = self.ranking(parent)
                for branch in range(self.config.branches):
                    child = self.score_state(State(select(ranking, parent.masks, count, branch * count,
                                                          self.config.layer_cap)))
                    if child.pruned() > parent.pruned() and self.acceptable(child, parent, base):
                        children.append(child)
            if not children:
                self.log(f"step {step}: no candidate kept; stopping")
                break
            children.sort(key=lambda s: s.scores["objective"])  # stable: ties keep the expansion order
            beams = children[:self.config.beam_width]
            if beams[0].scores["objective"] >= best.scores["objective"]:
                # Every child improves on its parent, not always on the best state of an earlier step.
                self.log(f"step {step}: no state better than the best so far; the beam searches on")
                continue
            best = beams[0]
            self.apply(best)
            if self._done(self._record(history, step, best, started)):
                break
        self.apply(best)
        return best, history


    def one_shot(self, fraction: float, seed: int = 0) -> tuple[State, list[dict]]:
        """No search: `fraction` of all prunable weights at once, the best-ranked (layer_cap holds),
        or chosen at random with method "random" (baselines)."""
        started = time.perf_counter()
        base = self.score_state(self.empty())
        history: list[dict] = []
        self._record(history, 0, base, started)
        count = int(fraction * self.total)
        if self.config.method == "random":
            state = random_state(self, count, seed)
        else:
            state = State(select(self.ranking(base), base.masks, count, 0, self.config.layer_cap))
        self._record(history, 1, self.score_state(state), started)
        return state, history


def sparsity_by_layer(state: State) -> dict[str, float]:
    return {name: float(mask.float().mean()) for name, mask in state.masks.items()}


def random_state(pruner: Pruner, count: int, seed: int) -> State:
    """A baseline: `count` weights pruned uniformly at random over all targets."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [m.numel() for m in pruner.originals.values()]
    picked = torch.randperm(sum(sizes), generator=generator)[:count]
    flat = torch.zeros(sum(sizes), dtype=torch.bool)
    flat[picked] = True
    masks, start = {}, 0
    for (name, weight), size in zip(pruner.originals.items(), sizes):
        masks[name] = flat[start:start + size].view_as(weight)
        start += size
    return State(masks)
