"""UoE and router-MoE layers against plain per-token references, on real gloo process groups:
single process (both VSE modes x all three scores, capacity dropping, bias, aux loss),
EP=2 vs EP=1 with the same weights, EP=2 x DP=2, EP=2 x TP=2 and TP=4 on 4 processes, and dispatch
edge cases (an expert with no tokens, every token to one expert, one token on a rank)."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from tests.dist_utils import spawn

EPS = 1e-6
ATOL = 2e-5  # fp32 batched vs per-token summation order
D, N, K, DE, NS = 16, 4, 2, 8, 3


# ----------------------------------------------------------------------------- reference

def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_weights(layer) -> dict:
    """Unsharded weights (gathered over TP and EP) as fresh leaves. Experts: [N, 2De, d], [N, d, De]."""
    tp = ps.get_tensor_model_parallel_group()
    experts = layer.experts.deepspeed_moe.experts.deepspeed_experts
    w_in = torch.stack([_gather(e.w_in, 0, tp) for e in experts])
    w_out = torch.stack([_gather(e.w_out, 1, tp) for e in experts])
    if layer.experts.ep_size > 1:
        ep = ps.get_expert_model_parallel_group()
        w_in, w_out = _gather(w_in, 0, ep), _gather(w_out, 0, ep)
    out = {"expert_in": w_in, "expert_out": w_out}
    if hasattr(layer, "vse_in"):
        out["vse_in"] = _gather(layer.vse_in.weight, 0, tp)
        out["vse_out"] = _gather(layer.vse_out.weight, 1, tp)
    else:
        out["router"] = layer.router.detach().clone()
        if layer.shared is not None:
            out["shared_in"] = _gather(layer.shared.w_in.weight, 0, tp)
            out["shared_out"] = _gather(layer.shared.w_out.weight, 1, tp)
    return {k: v.requires_grad_() for k, v in out.items()}


def swiglu(x, w_in, w_out):
    """x: [d]; the rows of w_in interleave gate and up per neuron."""
    return w_out @ (F.silu(w_in[0::2] @ x) * (w_in[1::2] @ x))


def topk_plain(values, k):
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


def capacity_keep(choices, n, capacity):
    used, keep = [0] * n, []
    for row in choices:
        keep.append([])
        for e in row:
            keep[-1].append(capacity is None or used[e] < capacity)
            used[e] += 1
    return keep


def switch_aux(probs, choices, n, k, coef):
    T = len(probs)
    f = [sum(row.count(i) for row in choices) / T for i in range(n)]
    p_mean = [sum(p[i] for p in probs) / T for i in range(n)]
    return coef * n / k * sum(f[i] * p_mean[i] for i in range(n))


def uoe_reference(x, w, n, k, ns, score, mode, coef, bias=None, capacity_factor=0.0):
    """x: [T, d]; returns (y [T, d], aux loss, dropped assignments)."""
    T = x.shape[0]
    G, P, O = w["vse_in"][0::2], w["vse_in"][1::2], w["vse_out"]
    probs, choices, weights, hs = [], [], [], []
    for t in range(T):
        norms, h_all = [], []
        for i in range(n):
            z = G[i * ns:(i + 1) * ns] @ x[t]
            h = F.silu(z) * (P[i * ns:(i + 1) * ns] @ x[t])
            a = {"h": h, "silu": F.silu(z), "z": z}[score]
            norms.append(torch.sqrt((a.float() ** 2).sum() + EPS))
            h_all.append(h)
        s = torch.stack(norms)
        chosen = topk_plain((s.detach() + (0 if bias is None else bias)).tolist(), k)
        probs.append(torch.softmax(s, 0))
        choices.append(chosen)
        weights.append(torch.softmax(s[chosen], 0))
        hs.append(h_all)
    keep = capacity_keep(choices, n, math.ceil(T * k / n * capacity_factor) if capacity_factor > 0 else None)
    rows = []
    for t in range(T):
        y = torch.zeros_like(x[t])
        for i in range(n):
            kept = i in choices[t] and keep[t][choices[t].index(i)]  # a dropped assignment: no scale
            c = 1.0 + weights[t][choices[t].index(i)] if mode == "overlap" and kept else 1.0
            y = y + c * (O[:, i * ns:(i + 1) * ns] @ hs[t][i])
        for j, e in enumerate(choices[t]):
            if keep[t][j]:
                y = y + weights[t][j] * swiglu(x[t], w["expert_in"][e], w["expert_out"][e])
        rows.append(y)
    return torch.stack(rows), switch_aux(probs, choices, n, k, coef), sum(not v for r in keep for v in r)


def carved_reference(x, w, n, k, ns, mode, coef):
    """UoE from whole experts (model.moe.sizing=carved): expert i is one SwiGLU of width D_e whose
    first ns neurons route. y = sum over all experts of their routing neurons' output + sum over the
    selected of w_i x (the whole expert: overlap, or its other neurons: disjoint). Score h, dropless."""
    G, P, O = w["vse_in"][0::2], w["vse_in"][1::2], w["vse_out"]
    whole = [(torch.cat([G[i * ns:(i + 1) * ns], w["expert_in"][i][0::2]]),
              torch.cat([P[i * ns:(i + 1) * ns], w["expert_in"][i][1::2]]),
              torch.cat([O[:, i * ns:(i + 1) * ns], w["expert_out"][i]], dim=1)) for i in range(n)]
    probs, choices, rows = [], [], []
    for t in range(x.shape[0]):
        h = [F.silu(g @ x[t]) * (p @ x[t]) for g, p, _ in whole]
        s = torch.stack([torch.sqrt((hi[:ns] ** 2).sum() + EPS) for hi in h])
        chosen = topk_plain(s.tolist(), k)
        weights = torch.softmax(s[chosen], 0)
        y = sum(whole[i][2][:, :ns] @ h[i][:ns] for i in range(n))
        for j, e in enumerate(chosen):
            part = slice(0, None) if mode == "overlap" else slice(ns, None)
            y = y + weights[j] * (whole[e][2][:, part] @ h[e][part])
        probs.append(torch.softmax(s, 0))
        choices.append(chosen)
        rows.append(y)
    return torch.stack(rows), switch_aux(probs, choices, n, k, coef), 0


def moe_reference(x, w, n, k, coef, capacity_factor=0.0):
    T = x.shape[0]
    probs, choices, weights = [], [], []
    for t in range(T):
        p = torch.softmax(w["router"] @ x[t].float(), 0)
        chosen = topk_plain(p.tolist(), k)
        probs.append(p)
        choices.append(chosen)
        weights.append(p[chosen] / p[chosen].sum())
    keep = capacity_keep(choices, n, math.ceil(T * k / n * capacity_factor) if capacity_factor > 0 else None)
    rows = []
    for t in range(T):
        y = torch.zeros_like(x[t])
        if "shared_in" in w:
            y = y + swiglu(x[t], w["shared_in"], w["shared_out"])
        for j, e in enumerate(choices[t]):
            if keep[t][j]:
                y = y + weights[t][j] * swiglu(x[t], w["expert_in"][e], w["expert_out"][e])
        rows.append(y)
    return torch.stack(rows), switch_aux(probs, choices, n, k, coef), sum(not v for r in keep for v in r)


# ----------------------------------------------------------------------------- harness

def make_cfg(kind: str, **moe):
    from models.config import ModelConfig
    from models.moe.routing import MoEConfig

    base = dict(num_experts=N, top_k=K, expert_hidden_size=DE, shared_hidden_size=N * NS, aux_loss_coef=0.01)
    base.update(moe)
    return ModelConfig(hidden_size=D, num_layers=2, mlp=kind, moe=MoEConfig(**base))


def build(kind: str, cfg, ep_size=None):
    from models.moe.router_moe import RouterMoE
    from models.moe.uoe import UnionOfExperts

    torch.manual_seed(1234)
    return (UnionOfExperts if kind == "uoe" else RouterMoE)(cfg, 0, ep_size)


def check_against_reference(kind: str, tokens: int = 10, bias=None, **moe) -> int:
    """Layer vs reference on this rank's tokens: outputs, aux loss, dropped count, and the gradients
    of x and of every (local shard of a) parameter. Tokens are shared by TP ranks, differ over DP."""
    cfg = make_cfg(kind, **moe)
    layer = build(kind, cfg)
    if bias is not None:
        layer.router_bias.copy_(bias)
    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    x = torch.randn(2, tokens // 2, D, generator=gen, requires_grad=True)
    g = torch.randn(2, tokens // 2, D, generator=gen)
    y = layer(x)
    aux = layer.aux_loss if layer.aux_loss is not None else torch.zeros(())
    ((y * g).sum() + aux).backward()

    w = full_weights(layer)
    xr = x.detach().reshape(-1, D).clone().requires_grad_()
    m = cfg.moe
    if kind == "uoe" and m.sizing == "carved":
        assert layer.routing_neurons + layer.experts.width == m.expert_hidden_size
        yr, auxr, dropped = carved_reference(xr, w, m.num_experts, m.top_k, layer.routing_neurons, m.vse_mode,
                                             m.aux_loss_coef)
    elif kind == "uoe":
        yr, auxr, dropped = uoe_reference(xr, w, m.num_experts, m.top_k, layer.routing_neurons, m.score,
                                          m.vse_mode, m.aux_loss_coef, bias, m.capacity_factor)
    else:
        yr, auxr, dropped = moe_reference(xr, w, m.num_experts, m.top_k, m.aux_loss_coef, m.capacity_factor)
    ((yr * g.reshape(-1, D)).sum() + auxr).backward()

    torch.testing.assert_close(y.reshape(-1, D), yr, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(aux, torch.as_tensor(auxr, dtype=aux.dtype), atol=1e-7, rtol=1e-5)
    assert layer.last_dropped == dropped
    torch.testing.assert_close(x.grad.reshape(-1, D), xr.grad, atol=ATOL, rtol=1e-4)
    _compare_param_grads(layer, w)
    return dropped


def _compare_param_grads(layer, w) -> None:
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    # Expert grads: the owner's grad sums the contributions of every rank of its EP group.
    gin, gout = w["expert_in"].grad.clone(), w["expert_out"].grad.clone()
    if layer.experts.ep_size > 1:
        dist.all_reduce(gin, group=ps.get_expert_model_parallel_group())
        dist.all_reduce(gout, group=ps.get_expert_model_parallel_group())
    local = layer.experts.num_local_experts
    first = (ps.get_expert_model_parallel_rank() if layer.experts.ep_size > 1 else 0) * local
    for i, expert in enumerate(layer.experts.deepspeed_moe.experts.deepspeed_experts):
        rows, cols = expert.w_in.shape[0], expert.w_out.shape[1]
        torch.testing.assert_close(expert.w_in.grad, gin[first + i, rows * tpr: rows * (tpr + 1)], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(expert.w_out.grad, gout[first + i, :, cols * tpr: cols * (tpr + 1)],
                                   atol=ATOL, rtol=1e-4)

    def split(full, dim):
        return full.chunk(tp, dim=dim)[tpr]

    if "vse_in" in w:
        torch.testing.assert_close(layer.vse_in.weight.grad, split(w["vse_in"].grad, 0), atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(layer.vse_out.weight.grad, split(w["vse_out"].grad, 1), atol=ATOL, rtol=1e-4)
    else:
        torch.testing.assert_close(layer.router.grad, w["router"].grad, atol=ATOL, rtol=1e-4)
        if "shared_in" in w:
            torch.testing.assert_close(layer.shared.w_in.weight.grad, split(w["shared_in"].grad, 0), atol=ATOL,
                                       rtol=1e-4)


# ----------------------------------------------------------------------------- workers

def _reference_suite(rank: int) -> None:
    for mode in ("overlap", "disjoint"):
        for score in ("h", "silu", "z"):
            check_against_reference("uoe", score=score, vse_mode=mode)
    for mode in ("overlap", "disjoint"):  # drops, no aux
        assert check_against_reference("uoe", tokens=16, capacity_factor=1.0, aux_loss_coef=0.0, vse_mode=mode) > 0
    check_against_reference("uoe", bias_update_rate=0.1, bias=torch.tensor([0.0, 0.5, -0.5, 0.05]))
    check_against_reference("uoe", routing_neurons=5, shared_hidden_size=0, top_k=3)
    for mode in ("overlap", "disjoint"):
        check_against_reference("uoe", sizing="carved", vse_mode=mode)
    check_against_reference("moe")
    check_against_reference("moe", shared_hidden_size=0, top_k=1)
    assert check_against_reference("moe", tokens=16, capacity_factor=0.75) > 0
    # Capacity is a training device: in evaluation the same layer routes every token, as dropless.
    for kind in ("uoe", "moe"):
        x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(5))
        dropping, dropless = build(kind, make_cfg(kind, capacity_factor=0.75)), build(kind, make_cfg(kind))
        assert dropping(x) is not None and dropping.last_dropped > 0  # training: it drops
        dropping.eval(), dropless.eval()
        with torch.no_grad():
            torch.testing.assert_close(dropping(x), dropless(x))
        assert dropping.last_dropped == 0


def _parallel_suite(rank: int) -> None:
    for kind in ("uoe", "moe"):
        check_against_reference(kind)
        check_against_reference(kind, tokens=16, capacity_factor=1.0)
    check_against_reference("uoe", vse_mode="disjoint", score="z")


def _ep2_vs_ep1(rank: int) -> None:
    """Same seed, EP=2 layer vs an all-local EP=1 layer: same outputs, aux loss and gradients."""
    for kind in ("uoe", "moe"):
        cfg = make_cfg(kind)
        ep2, ep1 = build(kind, cfg), build(kind, cfg, ep_size=1)
        assert ep2.experts.num_local_experts == N // 2 and ep1.experts.num_local_experts == N
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(3, 4, D, generator=gen)
        g = torch.randn(3, 4, D, generator=gen)
        grads = []
        for layer in (ep2, ep1):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            ((y * g).sum() + layer.aux_loss).backward()
            grads.append((y.detach(), layer.aux_loss.detach(), xi.grad))
        for a, b in zip(grads[0], grads[1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        dense2 = {n: p.grad for n, p in ep2.named_parameters() if "experts" not in n}
        dense1 = {n: p.grad for n, p in ep1.named_parameters() if "experts" not in n}
        assert dense2.keys() == dense1.keys() and dense2
        for name in dense2:
            torch.testing.assert_close(dense2[name], dense1[name], atol=1e-6, rtol=1e-5)
        e1 = ep1.experts.deepspeed_moe.experts.deepspeed_experts
        # EP=1: each rank's expert grads come from its own tokens; EP=2: the owner sees all tokens.
        totals = {p: torch.stack([getattr(e, p).grad for e in e1]) for p in ("w_in", "w_out")}
        for t in totals.values():
            dist.all_reduce(t)
        for i, e in enumerate(ep2.experts.deepspeed_moe.experts.deepspeed_experts):
            g_global = rank * (N // 2) + i
            torch.testing.assert_close(e.w_in, e1[g_global].w_in)  # same init at any EP size
            for pname in ("w_in", "w_out"):
                torch.testing.assert_close(getattr(e, pname).grad, totals[pname][g_global], atol=1e-6, rtol=1e-5)


def _dispatch_edges(rank: int) -> None:
    from models.moe.dispatch import dispatch_combine
    from models.moe.experts import ExpertContainer, grouped_swiglu

    cfg = make_cfg("moe")
    torch.manual_seed(5)
    ep2 = ExpertContainer(cfg, N, DE)
    torch.manual_seed(5)
    ep1 = ExpertContainer(cfg, N, DE, ep_size=1)
    group = ps.get_expert_model_parallel_group()
    cases = {
        # every token of both ranks to expert 3 (rank 0's experts get nothing)
        "all_to_one": ([[3, 3]] * 5, [[3, 3]] * 4),
        # one token on rank 0; rank 1 sends nothing to rank 0's experts
        "one_token": ([[0, 2]], [[3, 2], [2, 3]]),
        # a rank with no tokens at all
        "empty_rank": ([[1, 2], [0, 3]], []),
        # dropped assignments (-1) mixed in
        "dropped": ([[1, -1], [-1, -1]], [[-1, 0]]),
    }
    for name, per_rank in cases.items():
        ids = torch.tensor(per_rank[rank], dtype=torch.long).reshape(-1, 2)
        gen = torch.Generator().manual_seed(11 + rank)
        x = torch.randn(ids.shape[0], D, generator=gen)
        w = torch.rand(ids.shape[0], 2, generator=gen)
        out = []
        local2, local1 = ep2.deepspeed_moe.experts.deepspeed_experts, ep1.deepspeed_moe.experts.deepspeed_experts
        # EP=2 per-expert GEMMs, EP=1, and EP=2 with the experts as grouped GEMMs (empty groups included)
        for experts, grp, grouped in ((local2, group, False), (local1, None, False), (local2, group, True)):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            run_local = (lambda rows, counts, e=experts: grouped_swiglu(e, rows, counts)) if grouped else None
            for p in experts.parameters():
                p.grad = None
            y = dispatch_combine(xi, ids, wi, experts, N, grp, run_local)
            (y * (1 + torch.arange(D))).sum().backward()
            out.append((y.detach(), xi.grad, wi.grad, [p.grad for p in experts.parameters()]))
        for variant, other in enumerate(out[1:], 1):
            for what, a, b in zip(("output", "input grad", "weight grad"), out[0][:3], other[:3]):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name}, variant {variant}: {what}")
        for a, b in zip(out[0][3], out[2][3]):  # expert weight grads: grouped == per-expert
            if a is None or b is None:
                assert a is None and b is None or float((a if a is not None else b).abs().sum()) == 0, name
            else:
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name}: expert weight grad")


def _bias_update(rank: int) -> None:
    cfg = make_cfg("uoe", bias_update_rate=0.25)
    layer = build("uoe", cfg)
    # Each rank's counts alone would move the bias otherwise ([-, +, 0, 0] and [+, -, +, +]).
    layer.pending_counts.copy_(torch.tensor([[4.0, 0.0, 2.0, 2.0], [0.0, 6.0, 1.0, 1.0]][rank]))
    layer.after_optimizer_step()  # DP sum: [4, 6, 3, 3], mean 4
    torch.testing.assert_close(layer.router_bias, torch.tensor([0.0, -0.25, 0.25, 0.25]))
    assert float(layer.pending_counts.abs().sum()) == 0


def _deepspeed_groups(rank: int) -> None:
    """DeepSpeed's expert / expert-data groups are megatron-core's, for the layout in use."""
    from deepspeed.utils import groups

    from models.moe.experts import register_deepspeed_expert_groups

    name = register_deepspeed_expert_groups()
    assert name == f"ep_size_{ps.get_expert_model_parallel_world_size()}"
    assert groups._get_expert_parallel_group(name) is ps.get_expert_model_parallel_group()
    assert groups._get_expert_data_parallel_group(name) is ps.get_expert_data_parallel_group()
    assert groups._get_expert_parallel_group_dict()[name] is ps.get_expert_model_parallel_group()
    assert register_deepspeed_expert_groups() == name  # idempotent


def _engine_wiring(rank: int) -> None:
    """A real DeepSpeed engine on a UoE GPT: MoE detected, MoE-aware ZeRO param groups, expert groups
    identical to megatron-core's, and expert grads reduced over the expert-data-parallel group."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    from models.gpt import GPT
    from pretrain.config import Config
    from pretrain.engine import build_engine

    cfg = Config()
    cfg.model = make_cfg("uoe")
    cfg.model.vocab_size, cfg.model.max_seq_len, cfg.model.num_heads = 64, 8, 2
    cfg.train.precision, cfg.train.steps, cfg.train.warmup_steps = "fp32", 4, 1
    cfg.parallel.expert, cfg.parallel.zero_stage = ps.get_expert_model_parallel_world_size(), 2
    torch.manual_seed(0)
    engine = build_engine(cfg, GPT(cfg.model))
    name = f"ep_size_{cfg.parallel.expert}"
    assert engine.has_moe_layers
    assert engine.expert_parallel_group[name] is ps.get_expert_model_parallel_group()
    assert engine.expert_data_parallel_group[name] is ps.get_expert_data_parallel_group()
    assert dist.get_process_group_ranks(groups._get_expert_data_parallel_group(name)) == \
        dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    moe_groups = [g for g in engine.optimizer.optimizer.param_groups if g.get("moe")]
    dense_groups = [g for g in engine.optimizer.optimizer.param_groups if not g.get("moe")]
    assert moe_groups and {g["name"] for g in moe_groups} == {name}
    expert_params = [p for p in engine.module.parameters() if is_moe_param(p)]
    n_local = sum(p.numel() for p in expert_params)
    assert n_local == 2 * 3 * D * DE * N // cfg.parallel.expert  # 2 layers, this rank's experts
    assert all(not is_moe_param(p) for p in engine.module.parameters() if p.dim() == 1) and dense_groups
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    # Every rank stepped on its own tokens: the same weights after the step mean the gradients were
    # reduced, the experts' over their expert-data-parallel group, the rest over the data-parallel one.
    for name, param in engine.module.named_parameters():
        group = ps.get_expert_data_parallel_group() if is_moe_param(param) else ps.get_data_parallel_group()
        copies = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, param.detach().contiguous(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), name


# ----------------------------------------------------------------------------- tests

def _param_counts_exact(rank: int) -> None:
    """models.counting matches the modules: dense params once, experts summed over EP ranks."""
    from deepspeed.moe.utils import is_moe_param

    from models.counting import mlp_params, param_counts
    from models.gpt import GPT

    # Carved: each expert is D_e neurons in all, N_s of them routing; active = all routing + top-k rest.
    carved = make_cfg("uoe", sizing="carved")
    assert mlp_params(carved, 0) == (N * 3 * D * DE, 3 * D * (N * NS + K * (DE - NS)))
    assert mlp_params(make_cfg("uoe"), 0) == (N * 3 * D * (DE + NS), 3 * D * (N * NS + K * DE))
    for kind, moe in (("uoe", {}), ("moe", {}), ("uoe", {"sizing": "carved"})):
        cfg = make_cfg(kind, **moe)
        cfg.vocab_size, cfg.num_heads = 256, 2
        model = GPT(cfg)
        dense = sum(p.numel() for p in model.parameters() if not is_moe_param(p))
        experts = torch.tensor(float(sum(p.numel() for p in model.parameters() if is_moe_param(p))))
        dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
        assert dense + int(experts) == param_counts(cfg)["total"], kind
        # Activation checkpointing re-runs the dispatch in backward; statistics count it once.
        model.activation_checkpointing = "full"
        tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(rank))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        stats = model.blocks[0].mlp.stats
        routed = int(stats.as_tensor()[:cfg.moe.num_experts].sum())
        assert stats.totals()["tokens"] == 12 and stats.forwards == 1 and routed == 12 * cfg.moe.top_k
        assert all(p.grad is not None for p in model.parameters() if not is_moe_param(p)), kind


def _two_proc_suite(rank: int) -> None:
    _param_counts_exact(rank)
    _reference_suite(rank)
    _ep2_vs_ep1(rank)
    _dispatch_edges(rank)
    _bias_update(rank)
    _deepspeed_groups(rank)
    _engine_wiring(rank)


def test_layers_ep2_reference_ep1_equivalence_and_edge_cases():
    """EP=2 on 2 processes: every layer variant vs the reference, EP=2 vs EP=1, dispatch edge cases,
    bias update, DeepSpeed group agreement and a real engine step."""
    spawn(_two_proc_suite, 2, expert=2)


def _four_proc_suite(rank: int) -> None:
    """EP=2 x DP=4 (EDP=2; a real engine step too), then the same ranks re-initialised as TP=2 x EP=2
    (DP=2, EDP=1)."""
    from deepspeed.utils import groups

    _parallel_suite(rank)
    _deepspeed_groups(rank)
    _engine_wiring(rank)  # expert-data-parallel groups of 2: the experts' gradients reduced over them
    ps.destroy_model_parallel()
    groups._EXPERT_PARALLEL_GROUP.clear()
    groups._EXPERT_DATA_PARALLEL_GROUP.clear()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_expert_data_parallel_world_size() == 1
    _parallel_suite(rank)
    _deepspeed_groups(rank)
    # TP=4: UoE's routing neurons split so that ranks hold parts of experts (6 experts x 2 neurons,
    # 3 per rank: scored through index_add) or whole experts (4 x 3 neurons: through a per-expert view).
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    for experts, whole in ((6, False), (4, True)):
        moe = dict(num_experts=experts, routing_neurons=12 // experts, shared_hidden_size=0)
        assert build("uoe", make_cfg("uoe", **moe)).whole_experts == whole
        for mode in ("overlap", "disjoint"):
            check_against_reference("uoe", vse_mode=mode, **moe)


def test_four_processes_dp_and_tp():
    spawn(_four_proc_suite, 4, expert=2)


def test_routing_telemetry_sums_what_the_forwards_routed():
    """The statistics summed on the device over training forwards equal those recomputed from the
    routing decisions, scores, aux losses and output norms of the same forwards."""
    from pretrain.routing_metrics import RoutingTelemetry
    from tests.dist_utils import single_process_group

    with single_process_group():
        layer = build("uoe", make_cfg("uoe", capacity_factor=1.0))
        seen = {"selected": [], "scores": [], "aux": [], "vse": [], "routed": []}
        route = layer.route

        def spy_route(scores, *args, **kwargs):
            out = route(scores, *args, **kwargs)
            seen["selected"].append(out[1])
            seen["scores"].append(scores.detach())
            return out

        layer.route = spy_route
        layer.vse_out.register_forward_hook(lambda m, i, o: seen["vse"].append(o[0].detach().norm()))
        layer.experts.register_forward_hook(lambda m, i, o: seen["routed"].append(o.detach().norm()))
        dropped = 0
        for seed, tokens, norms in ((0, 12, True), (1, 20, True), (2, 16, False)):
            layer.stats.measure_norms = norms  # off: this forward's output norms are not summed
            x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(seed))
            layer(x)
            seen["aux"].append(float(layer.aux_loss.detach()))
            dropped += int(layer.last_dropped)
            if not norms:
                del seen["vse"][-1], seen["routed"][-1]
        metrics = RoutingTelemetry.collect([layer])
        counts = torch.bincount(torch.cat(seen["selected"]).reshape(-1), minlength=N).double()
        scores = torch.cat(seen["scores"]).double()
        for e in range(N):
            assert metrics[f"layer0/load_e{e}"] == pytest.approx(float(counts[e] / counts.sum()), abs=1e-12)
            assert metrics[f"layer0/score_e{e}"] == pytest.approx(float(scores[:, e].mean()), rel=1e-6)
        assert metrics["layer0/max_load"] == pytest.approx(float(counts.max() / counts.mean()), rel=1e-9)
        share = counts[counts > 0] / counts.sum()  # the load's entropy, over log of all N experts
        assert metrics["layer0/load_entropy"] == pytest.approx(float(-(share * share.log()).sum() / math.log(N)))
        assert dropped > 0 and metrics["layer0/dropped_tokens"] == dropped
        assert metrics["layer0/dropped_frac"] == pytest.approx(dropped / (48 * K))
        assert metrics["layer0/aux_loss"] == pytest.approx(sum(seen["aux"]) / 3, rel=1e-6)
        assert len(seen["vse"]) == len(seen["routed"]) == 2
        assert metrics["layer0/vse_over_routed"] == pytest.approx(float(sum(seen["vse"]) / sum(seen["routed"])),
                                                                  rel=1e-6)
        assert RoutingTelemetry.collect([layer]) == {}  # read once: the sums start again
        # In training, norms are measured on the steps whose metrics are logged.
        trainer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(log_interval=5, steps=12)))
        measured = []
        for step in range(1, 13):
            RoutingTelemetry([layer]).on_step_begin(trainer, step)
            measured.append(layer.stats.measure_norms)
        assert [s for s, m in zip(range(1, 13), measured) if m] == [5, 10, 12]
        # A router MoE reports each expert's mean router probability (its routing scores are log p);
        # some experts are never chosen here (positive inputs and router rows, expert N-1's negated):
        # the entropy of the load is still over log N.
        router = build("moe", make_cfg("moe"))
        with torch.no_grad():
            router.router.abs_()
            router.router[N - 1] *= -1
        x = torch.rand(24, D, generator=torch.Generator().manual_seed(3))
        router(x)
        probs = torch.softmax(x @ router.router.detach().T, -1)
        got = RoutingTelemetry.collect([router])
        for e in range(N):
            assert got[f"layer0/score_e{e}"] == pytest.approx(float(probs[:, e].mean()), rel=1e-5)
        load = torch.tensor([got[f"layer0/load_e{e}"] for e in range(N)], dtype=torch.float64)
        used = load[load > 0]
        assert load[N - 1] == 0 and 1 < len(used) < N
        assert got["layer0/load_entropy"] == pytest.approx(float(-(used * used.log()).sum() / math.log(N)))
        # Over layers: the mean entropy and the largest max load (the unbalanced router's, not the last's)
        layer(torch.randn(24, D, generator=torch.Generator().manual_seed(5)))
        router(x)
        layer.layer = 1  # its place in a model
        both = RoutingTelemetry.collect([router, layer])
        assert both["layer0/max_load"] > both["layer1/max_load"]
        assert both["max_load"] == both["layer0/max_load"]
        assert both["load_entropy"] == pytest.approx((both["layer0/load_entropy"] + both["layer1/load_entropy"]) / 2)


def test_router_z_loss_is_added_to_the_aux_loss_and_counted():
    from pretrain.routing_metrics import RoutingTelemetry
    from tests.dist_utils import single_process_group

    with single_process_group():
        x = torch.randn(12, D, generator=torch.Generator().manual_seed(0))
        plain = build("moe", make_cfg("moe"))
        plain(x)
        coef = 0.1
        layer = build("moe", make_cfg("moe", router_z_loss_coef=coef))
        layer(x)
        logits = F.linear(x.float(), layer.router.float())
        want = coef * torch.logsumexp(logits, dim=-1).square().mean()
        torch.testing.assert_close(layer.aux_loss - plain.aux_loss, want.detach())
        layer.aux_loss.backward()
        assert layer.router.grad is not None and layer.router.grad.abs().sum() > 0
        metrics = RoutingTelemetry.collect([layer])
        assert metrics["layer0/router_z_loss"] == pytest.approx(float(want.detach()))
        assert "layer0/router_z_loss" not in RoutingTelemetry.collect([plain])


def test_a_skipped_step_moves_no_selection_bias():
    """train.skip_spikes: a step that was not applied leaves the bias as it was and forgets its
    batch's counts; the next applied step moves it by its own counts only."""
    from models.gpt import GPT
    from models.moe.routing import sparse_layers
    from tests.dist_utils import single_process_group

    cfg = make_cfg("uoe", bias_update_rate=0.25)
    cfg.vocab_size, cfg.num_heads = 256, 2
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(cfg)
        layers = sparse_layers(model)
        model(tokens[:, :-1], tokens[:, 1:])
        assert all(float(layer.pending_counts.sum()) == 16 * K for layer in layers)
        model.after_optimizer_step(applied=False)
        assert all(not layer.router_bias.any() and not layer.pending_counts.any() for layer in layers)
        model(tokens[:, :-1], tokens[:, 1:])
        counts = [layer.pending_counts.clone() for layer in layers]
        model.after_optimizer_step()
        for layer, c in zip(layers, counts):
            torch.testing.assert_close(layer.router_bias, 0.25 * torch.sign(c.mean() - c))


def test_cast_parameters_keeps_the_buffers_as_deepspeed_does():
    """A frozen reference model in bf16 (DPO, SGA) routes and rotates as the policy DeepSpeed runs:
    its parameters rounded, its selection bias and RoPE tables in fp32 (a bf16 bias sent tokens near a
    tie to other experts)."""
    from models.gpt import GPT
    from models.moe.routing import sparse_layers
    from tests.dist_utils import single_process_group

    cfg = make_cfg("uoe", bias_update_rate=0.25)
    cfg.vocab_size, cfg.num_heads = 256, 2
    with single_process_group():
        torch.manual_seed(0)
        model = GPT(cfg)
        bias = torch.randint(-999, 1000, (cfg.moe.num_experts,), generator=torch.Generator().manual_seed(1)) * 1e-3
        for layer in sparse_layers(model):
            layer.router_bias.copy_(bias)
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        assert model.cast_parameters(torch.bfloat16) is model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert buffers and all(torch.equal(b, buffers[name]) and b.dtype == buffers[name].dtype
                           for name, b in model.named_buffers())
    assert any(name.endswith("router_bias") for name in buffers) and not torch.equal(bias.bfloat16().float(), bias)


@pytest.mark.parametrize("kind", ["uoe", "moe"])
def test_padding_takes_no_part_in_routing(kind):
    """A padded batch with its token mask routes its real tokens as those tokens alone: the same
    outputs, capacity drops, aux loss (and router z-loss), bias counts and statistics; padding
    (here one repeated vector, as padding's hidden states are) would otherwise crowd two experts.
    100 real tokens at capacity factor 1.1: 55 assignments per expert (55.000000000000007 in
    float64 arithmetic, which must not round up to 56); a bias sends every token to experts 0 and 1."""
    from tests.dist_utils import single_process_group

    extra = {"router_z_loss_coef": 0.1} if kind == "moe" else {}
    cfg = make_cfg(kind, capacity_factor=1.1, bias_update_rate=0.1, **extra)
    gen = torch.Generator().manual_seed(0)
    real = torch.randn(100, D, generator=gen)
    lengths = (40, 60)
    padded = torch.randn(D, generator=gen).expand(2, 70, D).clone()
    padded[0, :40], padded[1, :60] = real[:40], real[40:]
    mask = torch.arange(70)[None, :] < torch.tensor(lengths)[:, None]
    with single_process_group():
        alone, masked = build(kind, cfg), build(kind, cfg)
        for layer in (alone, masked):
            layer.router_bias.copy_(torch.tensor([50.0, 50.0, 0.0, 0.0]))
        want = alone(real)
        routed_ids = []
        experts_forward = masked.experts.forward
        masked.experts.forward = lambda x, ids, *rest: routed_ids.append(ids) or experts_forward(x, ids, *rest)
        got = masked(padded, mask)
        assert int(masked.last_dropped) == int(alone.last_dropped) > 0
        assert (routed_ids[0][~mask.reshape(-1)] == -1).all()  # with capacity, padding reaches no expert
        torch.testing.assert_close(got[mask], want)
        torch.testing.assert_close(masked.aux_loss, alone.aux_loss)
        assert torch.equal(masked.pending_counts, alone.pending_counts)
        torch.testing.assert_close(masked.stats.as_tensor(), alone.stats.as_tensor())
        assert masked.stats.totals()["tokens"] == 100 and int(alone.last_dropped) == 2 * (100 - 55)
        unmasked = build(kind, cfg)
        unmasked(padded)  # without the mask the 40 padding tokens count (and take capacity)
        assert unmasked.stats.totals()["tokens"] == 140 and not torch.equal(unmasked.pending_counts,
                                                                             alone.pending_counts)


@pytest.mark.parametrize("score,whole", [("h", True), ("silu", True), ("h", False), ("silu", False)])
def test_uoe_layer_keeps_what_the_planner_counts(score, whole, monkeypatch):
    """bf16: per routing neuron, what autograd keeps for a UoE layer's backward grows as the
    planner counts (the difference between two widths of routing neurons, within 2%), the whole
    within 15% of its activation elements per token, and no fp32 tensor as wide as the routing
    neurons is among it (the scores come from fp32 sums over the activations themselves). A rank
    holding parts of experts (tensor parallel; here forced at one rank) keeps the routing weights
    spread over their neurons too, as the planner counts."""
    from models.moe import uoe
    from models.moe.uoe import UnionOfExperts, activations
    from models.registry import ActivationLayout
    from tests.dist_utils import single_process_group

    if not whole:
        monkeypatch.setattr(uoe, "holds_whole_experts", lambda *sizes: False)
    tokens, experts = 512, 8
    eager_cpu = ActivationLayout(tensor=1, seq=tokens, flash=False, selective=False)  # the formula's SwiGLU
    measured, planned = {}, {}
    with single_process_group():
        for routing in (32, 64):
            cfg = make_cfg("uoe", num_experts=experts, routing_neurons=routing, expert_hidden_size=64,
                           score=score)
            cfg.hidden_size = 128
            torch.manual_seed(0)
            layer = UnionOfExperts(cfg, 0, ep_size=1).to(torch.bfloat16).train()
            x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
            kept = {}  # storage -> (bytes, dtype, elements)

            def keep(t):
                kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype, t.numel())
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                layer(x)
            for skip in (x, *layer.parameters()):
                kept.pop(skip.untyped_storage().data_ptr(), None)
            measured[routing] = sum(nbytes for nbytes, _, _ in kept.values()) / tokens / 2
            planned[routing] = activations(cfg, eager_cpu)
            wide_fp32 = [n for _, dtype, n in kept.values()
                         if dtype == torch.float32 and n >= tokens * routing]
            assert not wide_fp32, wide_fp32
    per_neuron = (measured[64] - measured[32]) / (experts * 32)
    planned_per_neuron = (planned[64] - planned[32]) / (experts * 32)
    assert per_neuron == pytest.approx(planned_per_neuron, rel=0.02), (measured, planned)
    assert measured[64] == pytest.approx(planned[64], rel=0.15), (measured, planned)


def test_grouped_gemm_auto_means_hopper_bf16_and_aligned_sizes(monkeypatch):
    """model.moe.grouped_gemm=auto: grouped GEMMs on a GPU of compute capability 9.x only, in bf16
    only and for sizes torch._grouped_mm takes; true (also set in code as True) and false as given."""
    import models.moe.experts as experts_module
    from models.moe.routing import MoEConfig
    from tests.dist_utils import single_process_group

    assert MoEConfig(grouped_gemm=True).grouped_gemm == "true" and MoEConfig().grouped_gemm == "auto"
    calls = []
    grouped = experts_module.grouped_swiglu
    monkeypatch.setattr(experts_module, "grouped_swiglu", lambda *a: calls.append(a[1].dtype) or grouped(*a))

    def runs_grouped(width: int, capability, setting="auto") -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
        calls.clear()
        layer = build("moe", make_cfg("moe", expert_hidden_size=width, grouped_gemm=setting))
        x = torch.randn(10, D)
        for dtype in (torch.float32, torch.bfloat16):
            layer.to(dtype)(x.to(dtype)).sum().backward()
        return list(calls)

    with single_process_group():
        assert runs_grouped(DE, (9, 0)) == [torch.bfloat16]
        assert runs_grouped(DE, (8, 0)) == runs_grouped(DE, (10, 0)) == runs_grouped(DE, None) == []
        assert runs_grouped(12, (9, 0)) == []  # 12 bf16 values are 24 bytes: not 16-byte aligned
        assert runs_grouped(DE, None, True) == [torch.float32, torch.bfloat16]
        assert runs_grouped(DE, (9, 0), "false") == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop_and_keep_no_stacked_weights(dtype):
    """grouped_swiglu gives each expert's SwiGLU on its rows (an expert without rows included),
    output and every gradient, eagerly and under torch.compile, and keeps no stack of the experts'
    weights for backward (nothing three-dimensional) either way: backward stacks them again."""
    from models.moe.experts import ExpertMLP, grouped_swiglu
    from tests.dist_utils import single_process_group

    with single_process_group():
        torch.manual_seed(0)
        experts = [ExpertMLP(16, 16).to(dtype) for _ in range(3)]
        for expert in experts:
            for param in expert.parameters():
                torch.nn.init.normal_(param, std=0.3)
        rows = [5, 0, 7]
        x = torch.randn(sum(rows), 16, dtype=dtype)
        grouped = partial(grouped_swiglu, experts, rows_per_expert=torch.tensor(rows))
        variants = {"loop": lambda inputs: torch.cat([e(c) for e, c in zip(experts, inputs.split(rows))]),
                    "grouped": grouped,
                    "grouped compiled": torch.compile(grouped, backend="aot_eager", fullgraph=True)}
        results = {}
        for name, run in variants.items():
            inputs = x.clone().requires_grad_()
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dim()) or t, lambda t: t):
                out = run(inputs)
            out.sum().backward()  # the output's gradient is a stride-0 expansion
            grads = [inputs.grad] + [p.grad.clone() for e in experts for p in e.parameters()]
            results[name] = (out.detach(), grads, max(kept))
            for expert in experts:
                expert.zero_grad()
    loop_out, loop_grads, _ = results.pop("loop")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, (out, grads, widest_kept) in results.items():
        torch.testing.assert_close(out, loop_out, **tol, msg=name)
        for grad, want in zip(grads, loop_grads):
            torch.testing.assert_close(grad, want, **tol, msg=name)
        assert widest_kept == 2, name
    for expert in experts:  # frozen experts (as tools.convert_lisa trains): the input's gradient alone
        expert.requires_grad_(False)
    inputs = x.clone().requires_grad_()
    grouped(inputs).sum().backward()
    torch.testing.assert_close(inputs.grad, loop_grads[0], **tol)


@pytest.mark.parametrize("may_drop", [False, True])
def test_dispatch_sums_rows_by_gathers_not_atomic_adds(may_drop):
    """dispatch_combine equals a per-token loop (float64; dropped assignments included), and neither
    its forward nor its backward accumulates rows into tokens with index_add / index_put (atomic
    adds on a GPU, in no fixed order: gradients that differ from run to run), eagerly and compiled."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.moe.dispatch import dispatch_combine

    class AtomicAdds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            accumulates = (name.startswith("index_add") or name.startswith("scatter_add")
                           or name.startswith(("index_put", "_index_put_impl"))
                           and (kwargs.get("accumulate") or (len(args) > 3 and args[3])))
            if accumulates and args[0].is_floating_point():
                self.seen.append(name)
            return func(*args, **kwargs)

    torch.manual_seed(0)
    experts = [torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(3)]
    x = torch.randn(7, 8, dtype=torch.float64)
    ids = torch.randint(0, 3, (7, 2))
    ids[:, 1] = (ids[:, 0] + 1) % 3
    if may_drop:
        ids[2, 1], ids[4] = -1, -1
    w = torch.rand(7, 2, dtype=torch.float64)

    def loop(x, w):
        return torch.stack([sum((w[t, k] * experts[ids[t, k]](x[t]) for k in range(2) if ids[t, k] >= 0),
                                torch.zeros(8, dtype=torch.float64)) for t in range(7)])

    compiled = torch.compile(dispatch_combine, backend="aot_eager")
    for name, run in (("loop", loop), ("eager", partial(dispatch_combine, expert_ids=ids, experts=experts,
                                                         num_experts=3, may_drop=may_drop)),
                      ("compiled", lambda x, w: compiled(x, ids, w, experts, 3, may_drop=may_drop))):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        for expert in experts:
            expert.zero_grad()
        with AtomicAdds() as mode:
            y = run(xi, weights=wi) if name == "eager" else run(xi, wi)
            (y * torch.arange(8)).sum().backward()
        got = [y, xi.grad, wi.grad] + [p.grad.clone() for e in experts for p in e.parameters()]
        if name == "loop":
            want = got
            continue
        assert mode.seen == [], (name, mode.seen)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, msg=name)
