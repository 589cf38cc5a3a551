"""Post-training losses as plain functions of log-probabilities; shapes in the docstrings.

Log-probabilities come from vocabulary-split logits (megatron-core's cross-entropy), so they are
right at any tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) [rows, L] from this rank's vocabulary shard of the logits [rows, L, V / tp]."""
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)


def sft_loss(logprobs: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the trained (response) tokens of the micro-batch."""
    trained = trained.float()
    return -(logprobs * trained).sum() / trained.sum().clamp(min=1)


def sequence_logprobs(logprobs: torch.Tensor, trained: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """[rows, L] -> [rows]: the summed log-probability of each row's response (`mean`: per token)."""
    summed = (logprobs * trained.float()).sum(-1)
    return summed / trained.sum(-1).clamp(min=1) if mean else summed


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
             ref_rejected: torch.Tensor | None, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0,
             gamma: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A preference loss on response log-probs [pairs] of the policy and the frozen reference, with
    h = (pi_w - ref_w) - (pi_l - ref_l), averaged over pairs:
      sigmoid  DPO, -log sigmoid(beta h); with label_smoothing e, the pairs taken as mislabelled with
               probability e: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h) (cDPO, as TRL's)
      ipo      IPO (Azar et al.), (h - 1 / (2 beta))^2, on per-token mean log-probs (as TRL's)
      hinge    SLiC's, max(0, 1 - beta h) (as TRL's)
      simpo    SimPO (Meng et al.), without a reference (ref_* None): h = pi_w - pi_l on per-token mean
               log-probs, -log sigmoid(beta h - gamma), label_smoothing as for sigmoid (TRL's CPO
               trainer with loss_type=simpo and cpo_alpha=0)
      orpo     ORPO's odds-ratio term (Hong et al.), without a reference: on per-token mean log-probs,
               -beta log sigmoid(log odds(pi_w) - log odds(pi_l)), odds(p) = p / (1 - p) (as TRL's; the
               chosen response's NLL, the rest of ORPO's loss, is the caller's)
    Metrics (detached): the implicit rewards beta (pi - ref) (without a reference: beta pi) of
    chosen and rejected, their margin and how often chosen wins; ORPO's log odds of chosen over
    rejected (TRL's log_odds_chosen) and their mean log sigmoid (TRL's log_odds_ratio)."""
    reward_chosen = beta * (chosen - ref_chosen) if ref_chosen is not None else beta * chosen
    reward_rejected = beta * (rejected - ref_rejected) if ref_rejected is not None else beta * rejected
    margin = reward_chosen - reward_rejected
    metrics = {}
    if kind == "ipo":
        loss = ((margin / beta - 1 / (2 * beta)) ** 2).mean()
    elif kind == "orpo":
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        loss = -beta * F.logsigmoid(log_odds).mean()
        metrics.update(log_odds_chosen=log_odds.mean(), log_odds_ratio=F.logsigmoid(log_odds).mean())
    elif kind == "hinge":
        loss = F.relu(1 - margin).mean()
    else:
        logits = margin - gamma if kind == "simpo" else margin
        loss = -((1 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)).mean()
    metrics.update(reward_chosen=reward_chosen.mean(), reward_rejected=reward_rejected.mean(),
                   reward_margin=margin.mean(), reward_accuracy=(margin > 0).float().mean())
    return loss, {k: v.detach() for k, v in metrics.items()}


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - p) from log p < 0, accurate where p is near 1 (where log1p(-exp) loses it); a mean
    log-probability that rounds to 0 is taken as just below it, not as p = 1 (log 0)."""
    return torch.log(-torch.expm1(logp.clamp(max=-1e-6)))


def value_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over pairs and objectives [pairs, m] (predicted after the sigmoid)."""
    return F.mse_loss(predicted.float(), target.float())
