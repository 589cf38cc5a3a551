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


def sequence_logprobs(logprobs: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """[rows, L] -> [rows]: the summed log-probability of each row's response."""
    return (logprobs * trained.float()).sum(-1)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO on summed response log-probs [pairs] of the policy and the frozen reference:
    mean of -log sigmoid(beta ((pi_w - ref_w) - (pi_l - ref_l))). Metrics (detached): the implicit
    rewards beta (pi - ref) of chosen and rejected, their margin and how often chosen wins."""
    reward_chosen = beta * (chosen - ref_chosen)
    reward_rejected = beta * (rejected - ref_rejected)
    margin = reward_chosen - reward_rejected
    loss = -F.logsigmoid(margin).mean()
    metrics = {"reward_chosen": reward_chosen.mean(), "reward_rejected": reward_rejected.mean(),
               "reward_margin": margin.mean(), "reward_accuracy": (margin > 0).float().mean()}
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over pairs and objectives [pairs, m] (predicted after the sigmoid)."""
    return F.mse_loss(predicted.float(), target.float())
