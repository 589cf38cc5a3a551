"""SGA's value head: an MLP on the final hidden state of a prompt's last token -> one score in
[0, 1] per objective (sigmoid). Replicated on every tensor-parallel rank (it is small)."""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int, objectives: int, layers: int = 3, width: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        sizes = [hidden_size] + [width] * layers
        mlp: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*mlp, nn.Linear(sizes[-1], objectives))

    @classmethod
    def from_spec(cls, spec: dict) -> ValueHead:
        """A head of the shape recorded in a checkpoint (see `spec`)."""
        return cls(spec["hidden_size"], len(spec["objectives"]), spec["layers"], spec["width"], spec["dropout"])

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[batch, hidden] -> scores [batch, objectives] in [0, 1]."""
        return torch.sigmoid(self.mlp(self.dropout(last_hidden)).float())


VALUE_HEAD_SHAPE = {"layers": "value_head_layers", "width": "value_head_width"}  # spec's keys -> post keys


def spec(hidden_size: int, objectives: list[str], post) -> dict:
    return {"hidden_size": hidden_size, "objectives": list(objectives), "layers": post.value_head_layers,
            "width": post.value_head_width, "dropout": post.value_head_dropout}


def last_token_states(hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """hidden [batch, seq, h], last [batch] -> [batch, h]: each row's state at its `last` index."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]
