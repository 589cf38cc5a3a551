"""Sampling from a model's logits: temperature, top-p and greedy decoding of one sequence, with a
KV cache."""

from __future__ import annotations

import torch

from models.attention.kv_cache import KVCache
from models.attention.relu import reads_row_length


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def context_window(tokens: list[int], max_len: int, bos: int | None = None) -> list[int]:
    """The last `max_len` tokens; with `bos`, a sequence beginning with it keeps it first (the samples
    of a model trained with data.start_with_bos all begin with it)."""
    if len(tokens) <= max_len:
        return tokens
    keep = tokens[:1] if bos is not None and tokens[0] == bos else []
    return keep + tokens[len(tokens) - max_len + len(keep):]


def can_cache(cfg) -> bool:
    """Whether decoding with a KV cache gives what recomputing the context gives: not with ReLU
    attention's seqlen normaliser (every row's normaliser changes as the sequence grows). Expert
    capacity drops tokens in training only, so it does not matter here."""
    return not reads_row_length(cfg)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             greedy: bool = False, eos_id: int | list[int] | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, bos: int | None = None) -> list[int]:
    """New token ids after `prompt`. Only real tokens (ids < model.vocab_size) are drawn. With the KV
    cache (models.attention.kv_cache, where can_cache allows) the prompt runs once and every new token
    alone; once the sequence fills max_seq_len, or without the cache, each token reruns the context
    (the last max_seq_len tokens; with `bos`, a prompt beginning with it keeps it first, as every
    sample of a model trained with data.start_with_bos begins)."""
    cfg = model.cfg
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())  # Llama 3 configs list several
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    device = next(model.parameters()).device
    tokens = list(prompt)
    cached = use_cache and can_cache(cfg) and len(prompt) < cfg.max_seq_len
    cache = KVCache(min(cfg.max_seq_len, len(prompt) + max_new_tokens)) if cached else None
    pending = tokens  # what the next forward runs, after the cache's positions
    new: list[int] = []
    for _ in range(max_new_tokens):
        if cache is not None and cache.length + len(pending) > cfg.max_seq_len:
            cache = None  # the context window is full: rerun the last max_seq_len tokens from here on
        if cache is None:
            pending = context_window(tokens, cfg.max_seq_len, bos)
        ctx = {"kv_cache": cache} if cache is not None else None
        last = model.hidden_states(torch.tensor([pending], device=device), ctx)[:, -1:]  # the head runs on it alone
        logits = model.output_logits(last)[0, -1, : cfg.vocab_size].float()
        if greedy or temperature <= 0:
            token = int(logits.argmax())
        else:
            # less the maximum first, in float64: a tiny temperature gives 0 and -inf, never inf - inf or 0 / 0
            scaled = (logits.double() - logits.max().double()) / temperature
            probs = filter_top_p(torch.softmax(scaled, dim=-1), top_p)
            token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        tokens.append(token)
        new.append(token)
        pending = [token]
        if token in stops:
            break
    return new
