"""Response-token masked Wanda attribution, streamed: forward hooks on every linear layer add up
the squares of its input features over the response tokens of a set of sequences, so the layer's
per-feature input RMS is known without keeping any activation. A weight's attribution on the set
is |W_ij| x rms_j (Wanda's |W| x ||X_j||, per token so that sets of different sizes compare).

Covered: megatron-core column / row parallel linears and torch linears (attention projections,
the dense and UoE virtual-expert MLPs, LISA's Q/K/V), and the routed experts' w_in / w_out, from
the rows each expert receives (a hook on the expert container, so it holds for the per-expert and
the grouped-GEMM paths alike). Embedding, output head and heads beside the LM are left out, as are
parameters used outside a linear (routers, LISA's head alignment). One process, TP=1 / EP=1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from models.layers import swiglu

EXCLUDED = ("embed.", "head.", "value_head.")


@dataclass
class Target:
    """One prunable weight [out, in] and the input statistics of the current collection."""
    name: str  # its key in model.state_dict()
    weight: torch.Tensor
    sumsq: torch.Tensor = field(default=None)  # float64 [in]
    tokens: int = 0

    def reset(self) -> None:
        self.sumsq = torch.zeros(self.weight.shape[1], dtype=torch.float64)
        self.tokens = 0

    def add(self, rows: torch.Tensor) -> None:
        self.sumsq += rows.detach().double().pow(2).sum(0).cpu()
        self.tokens += rows.shape[0]

    def rms(self) -> torch.Tensor:
        return (self.sumsq / max(self.tokens, 1)).sqrt().float()


LINEARS = (nn.Linear, tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)


class InputNorms:
    """Hooks on `model` (a GPT at TP=1) that collect Target statistics while `mask` is set."""

    def __init__(self, model: nn.Module):
        from models.moe.experts import ExpertContainer

        names = {id(p): n for n, p in model.named_parameters()}
        self.targets: list[Target] = []
        self.mask: torch.Tensor | None = None  # [positions] bool: the response tokens of the batch
        self._handles = []
        self.skipped: set[str] = set()  # targets whose inputs were not per token (never attributed)
        for module in model.modules():
            if isinstance(module, ExpertContainer):
                experts = list(module.deepspeed_moe.experts.deepspeed_experts)
                pairs = [(Target(names[id(e.w_in)], e.w_in), Target(names[id(e.w_out)], e.w_out)) for e in experts]
                self.targets += [t for pair in pairs for t in pair]
                self._handles.append(module.register_forward_pre_hook(self._expert_hook(experts, pairs)))
            elif isinstance(module, LINEARS) and getattr(module, "weight", None) is not None \
                    and module.weight.dim() == 2 and not names[id(module.weight)].startswith(EXCLUDED):
                target = Target(names[id(module.weight)], module.weight)
                self.targets.append(target)
                self._handles.append(module.register_forward_pre_hook(self._linear_hook(target)))
        self.reset()

    def reset(self) -> None:
        for target in self.targets:
            target.reset()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _linear_hook(self, target: Target):
        def hook(module, args):
            if self.mask is None:
                return
            rows = args[0].reshape(-1, args[0].shape[-1])
            if rows.shape[0] != self.mask.numel():
                self.skipped.add(target.name)
                return
            target.add(rows[self.mask])
        return hook

    def _expert_hook(self, experts, pairs):
        def hook(module, args):
            if self.mask is None:
                return
            x, expert_ids = args[0], args[1]
            for gid, (expert, (w_in, w_out)) in enumerate(zip(experts, pairs)):
                rows = x[(expert_ids == gid).any(-1) & self.mask]
                w_in.add(rows)
                w_out.add(swiglu(F.linear(rows, expert.w_in)))  # what the expert's w_out reads
        return hook

    @torch.no_grad()
    def collect(self, model: nn.Module, batches: list[dict]) -> dict[str, torch.Tensor]:
        """{target name: per-feature input RMS} over the response positions of `batches` (posttrain.batches
        rows: tokens [B, L + 1], trained [B, L + 1]): the positions whose next token is a response token
        (the ones the response's cross-entropy is computed at)."""
        self.reset()
        for batch in batches:
            self.mask = batch["trained"][:, 1:].reshape(-1)
            try:
                model.logits(batch["tokens"][:, :-1])
            finally:
                self.mask = None
        return {t.name: t.rms() for t in self.targets if t.name not in self.skipped}
