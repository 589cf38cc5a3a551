"""Turning layers of a trained model into LISA layers (models.attention.lisa): which layers'
attention maps repeat the previous layer's, and the converted model that shares them.

tools.convert_lisa runs it on a checkpoint and trains the new parameters.
"""

from __future__ import annotations

import copy

import torch

from models import registry
from models.attention.lisa import LISAAttention
from models.sinks import capture_attention


def head_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H_a, H_b] cosine similarity of attention maps a, b [batch, heads, q, k], batch-averaged."""
    fa = torch.nn.functional.normalize(a.float().flatten(2), dim=-1)  # [batch, H, q*k]
    fb = torch.nn.functional.normalize(b.float().flatten(2), dim=-1)
    return torch.einsum("bhn,bgn->bhg", fa, fb).mean(0)


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
def layer_similarity(model, batches: list[torch.Tensor]) -> dict[int, dict]:
    """For l >= 1: {"similarity": matched mean cosine, "unmatched": same-index mean cosine, "match": [...]}."""
    sims: dict[int, torch.Tensor] = {}
    for tokens in batches:
        maps = capture_attention(model, tokens)
        for layer in (layer for layer in maps if layer - 1 in maps):  # layers whose kinds expose weights
            s = head_similarity(maps[layer - 1], maps[layer])
            sims[layer] = sims.get(layer, 0) + s / len(batches)
    out = {}
    for layer, s in sims.items():
        match = greedy_match(s)
        out[layer] = {"similarity": float(torch.stack([s[p, n] for n, p in enumerate(match)]).mean()),
                      "unmatched": float(s.diagonal().mean()), "match": match}
    return out


def family(kinds: list[str], layer: int) -> str | None:
    """The weight function layer `layer` applies ("softmax" / "relu"; a LISA layer: its source's)."""
    source = registry.score_source(kinds, layer)
    return registry.attention_kind(source).score_family if source else None


def conversion_problem(kinds: list[str], layers: list[int], keep_full: int) -> str | None:
    """Why turning `layers` into LISA layers would change what the model computes, or None.
    A LISA layer applies the attention function of the nearest earlier layer that computes its own
    scores, so a replaced layer (and every existing LISA layer) must keep its softmax / ReLU family."""
    new = list(kinds)
    for layer in layers:
        if layer < max(keep_full, 1):
            return f"layer {layer} is within model.lisa.keep_full_layers={keep_full}"
        if registry.attention_kind(kinds[layer]).reads_previous_scores:
            return f"layer {layer} is already a LISA layer"
        new[layer] = "lisa"
    for layer, kind in enumerate(new):
        if kind != "lisa":
            continue
        want, got = family(kinds, layer), family(new, layer)
        if got is None or got != want:
            return (f"layer {layer} would share from a {registry.score_source(new, layer)} layer but computes "
                    f"{want} attention")
    return None


def propose_layers(sim: dict[int, dict], kinds: list[str], keep_full: int, threshold: float,
                   max_fraction: float) -> list[int]:
    """Most similar layers first, each kept only if the set stays convertible."""
    ranked = sorted((l for l in sim if conversion_problem(kinds, [l], keep_full) is None),
                    key=lambda l: -sim[l]["similarity"])
    limit = max(1, int(max_fraction * len(kinds)))
    chosen: list[int] = []
    for layer in ranked:
        if len(chosen) < limit and sim[layer]["similarity"] >= threshold and \
                conversion_problem(kinds, chosen + [layer], keep_full) is None:
            chosen.append(layer)
    return sorted(chosen or ranked[:1])


def lisa_config(cfg, layers: list[int]):
    problem = conversion_problem(cfg.attention_kinds(), layers, cfg.lisa.keep_full_layers)
    if problem:
        raise ValueError(f"cannot convert layers {layers}: {problem}")
    new = copy.deepcopy(cfg)
    kinds = cfg.attention_kinds()
    for layer in layers:
        kinds[layer] = "lisa"
    new.attention = ",".join(kinds)
    registry.validate_model(new)  # placement and sizes of the new LISA layers
    return new


@torch.no_grad()
def build_lisa_model(source, cfg, new_cfg, layers: list[int], sim: dict[int, dict]):
    from models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(new_cfg)
    own = model.state_dict()
    replaced = tuple(f"blocks.{i}.attn." for i in layers)
    for name, value in source.state_dict().items():
        if torch.is_tensor(value) and not name.startswith(replaced):
            own[name].copy_(value)  # everything outside the replaced attention layers, unchanged
    for i in layers:
        src_attn = source.blocks[i].attn
        lisa: LISAAttention = model.blocks[i].attn
        h, g, hd, d = cfg.num_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.hidden_size
        if not hasattr(src_attn, "qkv"):
            raise ValueError(f"layer {i} is already a LISA layer; choose other layers")
        qkv = src_attn.qkv.weight.view(cfg.kv_heads, g + 2, hd, d)  # grouped by K/V head
        lisa.v.weight.copy_(qkv[:, g + 1].reshape(cfg.kv_width, d))
        lisa.out.weight.copy_(src_attn.out.weight)
        group = lisa.align.group
        if group == h and i in sim:  # the matched head permutation: new head n reads previous head match[n]
            mix = torch.zeros(h, h)
            for n, p in enumerate(sim[i]["match"]):
                mix[n, p] = 1.0
            lisa.align.mix.copy_(mix.unsqueeze(0))
    return model


def new_parameters(model, layers: list[int]) -> list[torch.nn.Parameter]:
    params = []
    for i in layers:
        attn = model.blocks[i].attn
        params += list(attn.qk.parameters()) + list(attn.align.parameters())
    return params
