"""The dense MLP kind: one SwiGLU of width model.ffn_hidden_size (models.layers.SwiGLU)."""

from __future__ import annotations

import torch

from models.config import ConfigError, ModelConfig
from models.layers import SwiGLU, swiglu_kept
from models.registry import LlamaMapping, MLPKind, ParallelSizes, register_mlp


def params(cfg: ModelConfig) -> tuple[int, int]:
    n = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    return n, n


def to_llama(cfg: ModelConfig, state: dict, src: str, dst: str) -> dict:
    """Interleaved SwiGLU rows (gate_n, up_n) -> gate_proj / up_proj; w_out -> down_proj."""
    w_in = state[src + "w_in.weight"]
    return {dst + "gate_proj.weight": w_in[0::2], dst + "up_proj.weight": w_in[1::2],
            dst + "down_proj.weight": state[src + "w_out.weight"]}


def from_llama(cfg: ModelConfig, state: dict, src: str, dst: str) -> dict:
    gate, up = state[src + "gate_proj.weight"], state[src + "up_proj.weight"]
    return {dst + "w_in.weight": torch.stack([gate, up], dim=1).reshape(2 * cfg.ffn_hidden_size, cfg.hidden_size),
            dst + "w_out.weight": state[src + "down_proj.weight"]}


def validate(cfg: ModelConfig, sizes: ParallelSizes) -> None:
    if cfg.ffn_hidden_size % sizes.tensor:
        raise ConfigError(
            f"model.ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by parallel.tensor={sizes.tensor}")


register_mlp(MLPKind(
    name="dense", module=lambda cfg, layer: SwiGLU(cfg), params=params,
    activations=lambda cfg, layout: swiglu_kept(layout.fused_swiglu) * cfg.ffn_hidden_size / layout.tensor,
    validate=validate, llama=LlamaMapping(to_llama, from_llama), hf_remote=True, sections=(),
))
