"""Sampling from a model's logits: temperature, top-p and greedy decoding of one sequence."""

from __future__ import annotations

import torch


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             greedy: bool = False, eos_id: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """New token ids after `prompt` (a full forward per token: simple, fine for small models).
    Only real tokens (ids < model.vocab_size) are drawn; the context is the last max_seq_len tokens."""
    cfg = model.cfg
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-cfg.max_seq_len:]])
        logits = model.logits(context)[0, -1, : cfg.vocab_size].float()
        if greedy or temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = filter_top_p(torch.softmax(logits / temperature, dim=-1), top_p)
            token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new
