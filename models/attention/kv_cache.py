"""Keys and values of the positions already run, per layer, so that decoding a new token attends
to them without recomputing the prefix (models.generation).

GPT.hidden_states reads ``ctx["kv_cache"]``: the new tokens take positions ``length`` onwards
(RoPE), every layer appends its new keys and values (rotated keys; LISA layers their rank-r keys)
and attends with the new queries over all of them, and ``length`` then grows by the new tokens.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self):
        self.length = 0  # positions held
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's k, v [batch, heads, new, dim] -> those of every position so far."""
        held = self._layers.get(layer)
        if held is not None:
            k, v = torch.cat([held[0], k], dim=2), torch.cat([held[1], v], dim=2)
        self._layers[layer] = (k, v)
        return k, v
