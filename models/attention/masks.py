"""Which keys a query sees: causal, and optionally only within its own document.

A packed sample holds several documents, each ending with EOS. ``documents`` ([batch, seq] ints,
from :func:`document_ids`) numbers them; with it a query attends only to earlier keys of its own
document, so a packed sample gives each document the outputs it would get alone (RoPE scores depend
on relative positions only). Every attention kind takes ``documents=None`` for plain causal.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int | None) -> torch.Tensor | None:
    """[batch, seq] -> document index per position; an EOS belongs to the document it ends. None
    for eos_id None (a run without data.document_mask attends across documents)."""
    if eos_id is None:
        return None
    is_eos = (tokens == eos_id).long()
    return torch.cumsum(is_eos, dim=1) - is_eos


def causal_mask(q_len: int, k_len: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Boolean [q_len, k_len]: query i (at absolute position offset + i) sees keys j <= offset + i."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + offset
    return torch.arange(k_len, device=device).unsqueeze(0) <= rows


def visible(q_len: int, k_len: int, device: torch.device, documents: torch.Tensor | None = None,
            offset: int | None = None) -> torch.Tensor:
    """Boolean mask of the keys each query sees: [q_len, k_len] causal, or [batch, 1, q_len, k_len]
    causal within documents (queries offset..offset+q_len-1, keys 0..k_len-1; by default the
    queries are the last q_len positions, as when decoding after cached keys)."""
    offset = k_len - q_len if offset is None else offset
    causal = causal_mask(q_len, k_len, device, offset)
    if documents is None:
        return causal
    same = documents[:, offset:offset + q_len, None] == documents[:, None, :k_len]
    return (causal & same).unsqueeze(1)


def _positions(documents: torch.Tensor) -> torch.Tensor:
    return torch.arange(documents.shape[1], device=documents.device).expand_as(documents)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """[batch, seq] long: where each position's document starts (documents are contiguous runs)."""
    pos = _positions(documents)
    opens = torch.ones_like(documents, dtype=torch.bool)
    opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(opens, pos, torch.zeros_like(pos)).cummax(dim=1).values


def document_bounds(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([batch, seq], [batch, seq]) long: where each position's document starts, and one past where
    it ends."""
    pos = _positions(documents)
    closes = torch.ones_like(documents, dtype=torch.bool)
    closes[:, :-1] = documents[:, 1:] != documents[:, :-1]
    ends = torch.where(closes, pos + 1, torch.full_like(pos, documents.shape[1])).flip(1).cummin(dim=1).values.flip(1)
    return document_starts(documents), ends


def keys_seen(documents: torch.Tensor, q_len: int, offset: int = 0) -> torch.Tensor:
    """[batch, 1, q_len, 1] float: how many keys of its own document each query sees (itself included)."""
    starts = document_starts(documents)
    pos = torch.arange(documents.shape[1], device=documents.device)
    return (pos - starts + 1)[:, offset:offset + q_len].float()[:, None, :, None]
