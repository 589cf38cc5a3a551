"""Keys and values of the positions already run, per layer, so that decoding a new token attends
to them without recomputing the prefix (models.generation).

GPT.hidden_states reads ``ctx["kv_cache"]``: the new tokens take positions ``length`` onwards
(RoPE), every layer appends its new keys and values (rotated keys; LISA layers their rank-r keys)
and attends with the new queries over all of them, and ``length`` then grows by the new tokens.

Each layer's keys and values live in buffers with room to spare, written in place: appending one
token copies that token only (concatenating would copy the whole cache at every step, about a
tenth of a decode step at 1k positions on CPU). A full buffer doubles, unless `capacity` (the most
positions the caller will hold) sizes it from the start. The writes are in place, so the cache is
for inference: no backward runs through cached keys of an earlier forward.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, capacity: int = 0):
        self.length = 0  # positions held
        self.capacity = capacity
        # layer -> (keys, values) buffers [batch, heads, room, dim], and the positions filled
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's k, v [batch, heads, new, dim] -> those of every position so far (views of
        the buffers)."""
        keys, values, filled = self._layers.get(layer, (None, None, 0))
        if keys is not None and (k.shape[:2] != keys.shape[:2] or k.shape[3] != keys.shape[3]
                                 or k.dtype != keys.dtype or v.shape[3] != values.shape[3]):
            raise ValueError(f"layer {layer}: new keys {tuple(k.shape)} {k.dtype} do not match the cached "
                             f"{tuple(keys.shape)} {keys.dtype}; start a new KVCache for another batch or model")
        end = filled + k.shape[2]
        if keys is None or keys.shape[2] < end:
            room = max(end, self.capacity, 2 * keys.shape[2] if keys is not None else 0)
            keys, values = (self._grown(held, new, filled, room) for held, new in ((keys, k), (values, v)))
        keys[:, :, filled:end] = k
        values[:, :, filled:end] = v
        self._layers[layer] = (keys, values, end)
        return keys[:, :, :end], values[:, :, :end]

    @staticmethod
    def _grown(held: torch.Tensor | None, new: torch.Tensor, filled: int, room: int) -> torch.Tensor:
        b, h, _, d = new.shape
        buffer = new.new_empty(b, h, room, d)
        if held is not None:
            buffer[:, :, :filled] = held[:, :, :filled]
        return buffer

    def nbytes(self) -> int:
        """Bytes of the keys and values of the positions held (not the spare room)."""
        return sum(keys[:, :, :filled].nbytes + values[:, :, :filled].nbytes
                   for keys, values, filled in self._layers.values())

    def copy(self) -> KVCache:
        """An independent cache of the same positions, for decoding several continuations of one
        prefill (the buffers are written in place, so they are copied)."""
        out = KVCache(self.capacity)
        out.length = self.length
        out._layers = {layer: (keys.clone(), values.clone(), filled)
                       for layer, (keys, values, filled) in self._layers.items()}
        return out
