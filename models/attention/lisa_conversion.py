"""Turning layers of a trained model into LISA layers (models.attention.lisa): which layers'
attention maps repeat the previous layer's, and the converted model that shares them.

A converted layer starts from the trained weights:
* head alignment: within each alignment group of g heads, new head n reads the previous layer's
  head of that group whose maps are most like its own (a one-to-one greedy matching), M = that
  permutation;
* low-rank Q/K (qk_init): "zero" (key half zero: pure aligned sharing), "own" (no sharing at
  first, M = 0: the replaced layer's own Q/K on the RoPE pairs the rank-r rotary has; at r =
  head_dim the converted layer computes exactly the replaced layer's scores) or "residual" (M =
  the permutation, and on those pairs the best rank-1 complex approximation of the replaced head's
  bilinear form minus its matched previous head's; exact at r = head_dim whenever the two differ
  by at most one complex rank per pair and both layers see the same input: it works in weight
  space, while the previous block has already changed the residual stream).
Rank-r RoPE pair m rotates at base^(-2m/r), which is pair m * head_dim / r of a full head (half-
split layout, models.layers.Rotary), so those pairs carry over exactly; the others cannot.

tools.convert_lisa runs it on a checkpoint and trains the new parameters.
"""

from __future__ import annotations

import copy
import math

import torch

from models import registry
from models.attention.lisa import LISAAttention, chained_lisa_layers
from models.sinks import capture_attention


def head_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H_a, H_b] cosine similarity of attention maps a, b [batch, heads, q, k], batch-averaged."""
    fa = torch.nn.functional.normalize(a.float().flatten(2), dim=-1)  # [batch, H, q*k]
    fb = torch.nn.functional.normalize(b.float().flatten(2), dim=-1)
    return torch.einsum("bhn,bgn->bhg", fa, fb).mean(0)


QK_INITS = ("zero", "own", "residual")


def greedy_match(sim: torch.Tensor) -> list[int]:
    """match[h_new] = h_prev, one to one, taking the most similar remaining pair first."""
    sim = sim.clone()
    match = [-1] * sim.shape[1]
    for _ in range(sim.shape[0]):
        flat = int(torch.argmax(sim))
        prev, new = divmod(flat, sim.shape[1])
        match[new] = prev
        sim[prev, :] = -float("inf")
        sim[:, new] = -float("inf")
    return match


@torch.no_grad()
def layer_similarity(model, batches: list[torch.Tensor], documents: list | None = None) -> dict[int, dict]:
    """For l >= 1: {"similarity": matched mean cosine, "unmatched": same-index mean cosine, "match": [...]}.
    documents: per batch its document ids (a model trained within documents), or None."""
    sims: dict[int, torch.Tensor] = {}
    for tokens, docs in zip(batches, documents or [None] * len(batches)):
        maps = capture_attention(model, tokens, docs, row_length=model.cfg.max_seq_len)  # as trained
        for layer in (layer for layer in maps if layer - 1 in maps):  # layers whose kinds expose weights
            s = head_similarity(maps[layer - 1], maps[layer])
            sims[layer] = sims.get(layer, 0) + s / len(batches)
    out = {}
    for layer, s in sims.items():
        match = greedy_match(s)
        out[layer] = {"similarity": float(torch.stack([s[p, n] for n, p in enumerate(match)]).mean()),
                      "unmatched": float(s.diagonal().mean()), "match": match,
                      "heads": s.tolist()}  # [previous head, new head] cosine similarity
    return out


def match_in_groups(sim: torch.Tensor, group: int) -> list[int]:
    """match[h_new] = h_prev with both heads in the same alignment group of `group` heads (the
    alignment mixes heads only within groups), one to one per group."""
    match = []
    for start in range(0, sim.shape[0], group):
        block = sim[start:start + group, start:start + group]
        match += [start + p for p in greedy_match(block)]
    return match


def family(kinds: list[str], layer: int) -> str | None:
    """The weight function layer `layer` applies ("softmax" / "relu"; a LISA layer: its source's)."""
    source = registry.score_source(kinds, layer)
    return registry.attention_kind(source).score_family if source else None


def conversion_problem(kinds: list[str], layers: list[int], keep_full: int, max_chain: int = 0) -> str | None:
    """Why turning `layers` into LISA layers would change what the model computes, or make a chain
    of more than `max_chain` LISA layers in a row (0: any) that holds a new one; None if nothing.
    A LISA layer applies the attention function of the nearest earlier layer that computes its own
    scores, so a replaced layer (and every existing LISA layer) must keep its softmax / ReLU family,
    and a replaced layer must compute its family's plain function (softmax_sink adds a sink logit,
    which a LISA layer has not)."""
    new = list(kinds)
    if len(set(layers)) != len(layers):
        return f"layers {sorted(layers)} name a layer twice"
    for layer in layers:
        if not 0 <= layer < len(kinds):
            return f"layer {layer} is not a layer of this {len(kinds)}-layer model (0 to {len(kinds) - 1})"
        if layer == 0:
            return "layer 0 has no earlier layer whose attention scores a LISA layer could reuse"
        if layer < keep_full:
            return f"layer {layer} is within model.lisa.keep_full_layers={keep_full}"
        kind = registry.attention_kind(kinds[layer])
        if kind.reads_previous_scores:
            return f"layer {layer} is already a LISA layer"
        if kind.score_family is None:
            return f"layer {layer} is a {kind.name} layer, whose attention a LISA layer cannot compute"
        if kind.name != kind.score_family:
            return (f"layer {layer} is a {kind.name} layer: a LISA layer computes plain {kind.score_family} "
                    f"attention, so converting it would drop what {kind.name} adds")
        new[layer] = "lisa"
    for layer, kind in enumerate(new):
        if kind != "lisa":
            continue
        want, got = family(kinds, layer), family(new, layer)
        if got is None or got != want:
            return (f"layer {layer} would share from a {registry.score_source(new, layer)} layer but computes "
                    f"{want} attention")
    for first, last in chains(new):
        if max_chain and last - first + 1 > max_chain and any(first <= layer <= last for layer in layers):
            return (f"layers {first}-{last} would be {last - first + 1} LISA layers in a row, "
                    f"more than {max_chain}")
    return None


def chains(kinds: list[str]) -> list[tuple[int, int]]:
    """(first, last) of each run of layers in a row that reuse the previous layer's scores."""
    runs: list[tuple[int, int]] = []
    for layer, kind in enumerate(kinds):
        if not registry.attention_kind(kind).reads_previous_scores:
            continue
        if runs and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def propose_layers(sim: dict[int, dict], kinds: list[str], keep_full: int, threshold: float,
                   max_fraction: float, max_chain: int = 0) -> list[int]:
    """Most similar layers first, each kept only if the set stays convertible (and its chains
    within max_chain)."""
    ranked = sorted((l for l in sim if conversion_problem(kinds, [l], keep_full, max_chain) is None),
                    key=lambda l: -sim[l]["similarity"])
    limit = max(1, int(max_fraction * len(kinds)))
    chosen: list[int] = []
    for layer in ranked:
        if len(chosen) < limit and sim[layer]["similarity"] >= threshold and \
                conversion_problem(kinds, chosen + [layer], keep_full, max_chain) is None:
            chosen.append(layer)
    return sorted(chosen or ranked[:1])


def sensitive_layers(source, cfg, sim: dict[int, dict], loss, qk_init: str, budget: float,
                     max_fraction: float, max_chain: int = 0) -> tuple[list[int], dict[int, float]]:
    """Layer choice by measured sensitivity. `loss(model)` is a validation loss. Every candidate
    layer is converted alone (no training) and its relative loss increase over the source's
    measured; then, least sensitive first, a layer joins when the measured increase of the whole
    set stays within `budget` (and its chains within max_chain), up to `max_fraction` of the layers.
    Returns (layers, increase alone)."""
    base = loss(source)
    kinds, keep = cfg.attention_kinds(), cfg.lisa.keep_full_layers

    def increase(layers: list[int]) -> float:
        return loss(build_lisa_model(source, cfg, lisa_config(cfg, layers), layers, sim, qk_init)) / base - 1

    def candidate(layer: int) -> bool:  # residual needs the previous layer's own Q/K
        return conversion_problem(kinds, [layer], keep, max_chain) is None and \
            (qk_init != "residual" or hasattr(source.blocks[layer - 1].attn, "qkv"))

    alone = {layer: increase([layer]) for layer in range(len(kinds)) if candidate(layer)}
    limit = max(1, int(max_fraction * len(kinds)))
    chosen: list[int] = []
    for layer in sorted(alone, key=alone.get):
        trial = sorted(chosen + [layer])
        if len(chosen) < limit and alone[layer] <= budget and \
                conversion_problem(kinds, trial, keep, max_chain) is None and increase(trial) <= budget:
            chosen = trial
    return chosen, alone


def lisa_config(cfg, layers: list[int], keep_chain_scores: bool | None = None):
    """cfg with `layers` made LISA layers; model.lisa.keep_chain_scores as given, or (None) on where
    LISA layers follow each other (a chain's layers then align their rows once, not once per later
    layer: 2.6x -> 1.4x the source's training step at 75% shared, bench.lisa_train_step)."""
    kinds = cfg.attention_kinds()
    problem = conversion_problem(kinds, layers, cfg.lisa.keep_full_layers)
    if problem:
        raise ValueError(f"cannot convert layers {layers}: {problem}")
    new = copy.deepcopy(cfg)
    kinds = [("lisa" if i in layers else kind) for i, kind in enumerate(kinds)]
    new.attention = ",".join(kinds)
    if keep_chain_scores is None:
        keep_chain_scores = bool(chained_lisa_layers(kinds))
    new.lisa.keep_chain_scores = keep_chain_scores
    registry.validate_model(new)  # placement and sizes of the new LISA layers
    return new


def head_qk(attn, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """A projected layer's Q rows [heads, head_dim, d] and, per query head, its K/V group's K rows."""
    h, g, hd, d = cfg.num_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    qkv = attn.qkv.weight.view(cfg.kv_heads, g + 2, hd, d)
    return qkv[:, :g].reshape(h, hd, d), qkv[:, g].repeat_interleave(g, dim=0)


def carried_pairs(head_dim: int, rank: int) -> list[int]:
    """The RoPE pairs of a full head that a rank-`rank` rotary has: pair m * head_dim / rank for m < rank / 2."""
    if head_dim % rank:
        raise ValueError(f"qk_init own/residual needs model.lisa.rank ({rank}) to divide head_dim ({head_dim}), "
                         "so that the low-rank RoPE frequencies are a subset of the head's; use qk_init=zero or "
                         "another rank")
    return [m * (head_dim // rank) for m in range(rank // 2)]


def _pairs(w: torch.Tensor, pairs: list[int]) -> torch.Tensor:
    """Rows [.., head_dim, d] -> complex [.., len(pairs), d]: half-split RoPE pair p is rows (p, p + head_dim/2)."""
    half = w.shape[-2] // 2
    idx = torch.tensor(pairs)
    return torch.complex(w[..., idx, :].double(), w[..., idx + half, :].double())


def _rows(c: torch.Tensor) -> torch.Tensor:
    """Complex [.., pairs, d] -> half-split rows [.., 2 * pairs, d]."""
    return torch.cat([c.real, c.imag], dim=-2)


def rank1(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """Best rank-1 (u, v) with outer(u, conj(v)) ~ outer(a0, conj(b0)) - outer(a1, conj(b1)) (complex [d] each):
    through thin QRs of [a0 a1] and [b0 b1], then the SVD of the 2 x 2 core."""
    qa, ra = torch.linalg.qr(torch.stack(a, dim=1))
    qb, rb = torch.linalg.qr(torch.stack(b, dim=1))
    core = ra @ torch.diag(torch.tensor([1.0, -1.0], dtype=ra.dtype)) @ rb.conj().T
    u, sigma, vh = torch.linalg.svd(core)
    scale = sigma[0].sqrt()
    return scale * (qa @ u[:, 0]), scale * (qb @ vh[0].conj())


def low_rank_qk(cfg, attn, prev, match: list[int], rank: int, qk_init: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The LISA layer's low-rank Q and K rows [heads, rank, d] for the replaced layer `attn` and the
    layer before it `prev` (residual), scaled so that their rank-r scores (divided by sqrt(r)) equal
    the promised share of the full scores (divided by sqrt(head_dim))."""
    pairs = carried_pairs(cfg.head_dim, rank)
    q, k = (_pairs(w, pairs) for w in head_qk(attn, cfg))  # [heads, rank/2, d] complex
    if qk_init == "residual":
        pq, pk = (_pairs(w, pairs)[match] for w in head_qk(prev, cfg))  # the matched previous heads
        for h in range(cfg.num_heads):
            for m in range(len(pairs)):
                q[h, m], k[h, m] = rank1((q[h, m], pq[h, m]), (k[h, m], pk[h, m]))
    scale = math.sqrt(rank / cfg.head_dim)
    return _rows(q) * scale, _rows(k)


@torch.no_grad()
def build_lisa_model(source, cfg, new_cfg, layers: list[int], sim: dict[int, dict], qk_init: str = "zero"):
    """The converted model (see the module docstring); `sim` from layer_similarity (may be empty:
    identity alignment)."""
    from models.gpt import GPT

    if qk_init not in QK_INITS:
        raise ValueError(f"qk_init={qk_init!r}: choose one of {', '.join(QK_INITS)}")
    torch.manual_seed(0)
    model = GPT(new_cfg).to(next(source.parameters()).dtype)  # the source's precision
    own = model.state_dict()
    replaced = tuple(f"blocks.{i}.attn." for i in layers)
    for name, value in source.state_dict().items():
        if torch.is_tensor(value) and not name.startswith(replaced):
            own[name].copy_(value)  # everything outside the replaced attention layers, unchanged
    for i in layers:
        src_attn = source.blocks[i].attn
        lisa: LISAAttention = model.blocks[i].attn
        g, hd, d = cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.hidden_size
        if not hasattr(src_attn, "qkv"):
            raise ValueError(f"layer {i} is already a LISA layer; choose other layers")
        qkv = src_attn.qkv.weight.view(cfg.kv_heads, g + 2, hd, d)  # grouped by K/V head
        lisa.v.weight.copy_(qkv[:, g + 1].reshape(cfg.kv_width, d))
        lisa.out.weight.copy_(src_attn.out.weight)
        group = lisa.align.group
        match = (match_in_groups(torch.tensor(sim[i]["heads"]), group) if i in sim
                 else list(range(cfg.num_heads)))
        mix = torch.zeros(cfg.num_heads // group, group, group)
        for n, p in enumerate(match):  # new head n reads previous head p (same group)
            mix[n // group, n % group, p % group] = 1.0
        if qk_init == "own":
            mix.zero_()  # the layer starts as the replaced layer (on the carried RoPE pairs)
        lisa.align.mix.copy_(mix)
        if qk_init != "zero":
            prev = source.blocks[i - 1].attn
            if qk_init == "residual" and not hasattr(prev, "qkv"):
                raise ValueError(f"qk_init=residual: layer {i - 1} of the source computes no Q/K of its own "
                                 "(a LISA layer); use qk_init=own or zero")
            q, k = low_rank_qk(cfg, src_attn, prev, match, lisa.rank, qk_init)
            lisa.qk.weight.view(cfg.num_heads, 2, lisa.rank, d).copy_(torch.stack([q, k], dim=1))
    return model


def new_parameters(model, layers: list[int]) -> list[torch.nn.Parameter]:
    params = []
    for i in layers:
        attn = model.blocks[i].attn
        params += list(attn.qk.parameters()) + list(attn.align.parameters())
    return params
