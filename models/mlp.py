"""MLP kind per layer: dense SwiGLU, top-k router MoE or Union-of-Experts."""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig
from models.layers import SwiGLU


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    kind = cfg.mlp_kind(layer)
    if kind == "dense":
        return SwiGLU(cfg)
    if kind == "moe":
        from models.moe.router_moe import RouterMoE

        return RouterMoE(cfg, layer)
    if kind == "uoe":
        from models.moe.uoe import UnionOfExperts

        return UnionOfExperts(cfg, layer)
    raise ValueError(f"model.mlp={kind!r}: choose dense, moe or uoe")
