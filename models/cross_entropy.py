"""Vocab-parallel cross-entropy that also returns the logsumexp, for the z-loss.

    ce, lse = cross_entropy_and_logsumexp(logits, labels)   # logits [..., V / tp] -> ce, lse [...]
    loss = ce.mean() + z_loss * lse.square().mean()

megatron-core's vocab_parallel_cross_entropy computes the logsumexp and keeps the softmax for
backward; a z-loss on a separate logsumexp would keep a second fp32 logits-sized tensor (2 GiB at
8 x 2048 tokens and a 32k vocabulary) and read the logits once more. Here one pass gives both, and
backward uses the one saved softmax: d/dlogits = softmax * (g_ce + g_lse) - onehot(label) * g_ce.
The forward runs megatron-core's own steps (its VocabParallelCrossEntropy helpers); like its
function, it overwrites fp32 logits in place.
"""

from __future__ import annotations

import torch
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility


class _CrossEntropyAndLogsumexp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor):
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
        group = get_tensor_model_parallel_group()
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = \
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, start, end)
        torch.distributed.all_reduce(predicted, group=group)
        torch.distributed.all_reduce(sum_exp, group=group)
        softmax, ce = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return ce, sum_exp.log() + logits_max

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_lse: torch.Tensor):  # zeros for an output not used
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad = softmax.mul_((grad_ce + grad_lse).unsqueeze(-1))  # in place, as megatron-core's backward
        grad_2d = grad.view(-1, grad.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad.device)
        on_this_rank = 1.0 - target_mask.view(-1).to(grad.dtype)
        grad_2d[rows, masked_target_1d] -= on_this_rank * grad_ce.reshape(-1)
        return grad, None


def cross_entropy_and_logsumexp(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, logsumexp over the whole vocabulary) per position, both [...], the same on
    every tensor-parallel rank, of this rank's vocab-split logits [..., V / tp] and full labels [...]."""
    return _CrossEntropyAndLogsumexp.apply(logits, target)
