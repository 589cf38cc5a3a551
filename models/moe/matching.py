"""Matched UoE / MoE+shared-expert / dense configs from one size.

Given d, layers, N experts, top-k, expert width D_e and shared width D_s (D_s % N == 0):
* UoE ("additive", spec section 1.4): experts hold N_s = D_s / N routing neurons + D_e rest neurons;
  the VSE (N * N_s = D_s wide) replaces the shared expert. No router.
* MoE+shared: N experts of width D_e, one shared expert of width D_s, a learned router (N x d).
* dense: a SwiGLU of width K * D_e + D_s, the active MLP width of both sparse models.
UoE and MoE then have identical expert and shared/VSE parameters and active matmul FLOPs; they
differ only by MoE's router (N * d parameters per layer, also counted as active), which
`parity()` reports exactly.

The size presets and the configs/ files written from them: tools.matching.
"""

from __future__ import annotations

import copy

from models.config import ModelConfig
from models.counting import flops_per_token, param_counts
from models.moe.routing import MoEConfig


def matched_models(base: ModelConfig, num_experts: int, top_k: int, expert_hidden: int,
                   shared_hidden: int, **moe_extra) -> dict[str, ModelConfig]:
    if shared_hidden % num_experts:
        raise ValueError(f"shared width {shared_hidden} must be divisible by {num_experts} experts (N_s = D_s / N)")
    sizing = {"sizing", "routing_neurons", "expert_hidden_size", "shared_hidden_size"} & set(moe_extra)
    if sizing:  # the dense twin's width is K x D_e + D_s of the additive sizing these arguments give
        raise ValueError(f"matched_models sets {', '.join(sorted(sizing))} itself (additive sizing, N_s = D_s / N); "
                         "other widths would leave the models unmatched")
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden_size=expert_hidden,
                    shared_hidden_size=shared_hidden, routing_neurons=shared_hidden // num_experts, **moe_extra)
    out = {}
    for kind in ("uoe", "moe"):
        cfg = copy.deepcopy(base)
        cfg.mlp, cfg.moe = kind, copy.deepcopy(moe)
        out[kind] = cfg
    dense = copy.deepcopy(base)
    dense.mlp, dense.moe = "dense", MoEConfig()
    out["dense"] = dense
    for cfg in out.values():  # the sparse models' dense layers too (model.moe.moe_layers): matched as well
        cfg.ffn_hidden_size = top_k * expert_hidden + shared_hidden
    return out


def parity(models: dict[str, ModelConfig]) -> dict[str, dict]:
    """Parameter / FLOP counts per kind, and UoE minus MoE in both (= minus the routers)."""
    table = {kind: {**param_counts(cfg), "flops_per_token": flops_per_token(cfg)} for kind, cfg in models.items()}
    moe = models["moe"]
    router = sum(moe.hidden_size * moe.moe.num_experts for i in range(moe.num_layers) if moe.mlp_kind(i) == "moe")
    table["uoe_minus_moe"] = {"total": table["uoe"]["total"] - table["moe"]["total"],
                              "active": table["uoe"]["active"] - table["moe"]["active"],
                              "flops_per_token": table["uoe"]["flops_per_token"] - table["moe"]["flops_per_token"],
                              "routers": router}
    return table
