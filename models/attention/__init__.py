"""Attention kinds, chosen per layer by `ModelConfig.attention`."""

from __future__ import annotations

from torch import nn

from models.attention.softmax import SoftmaxAttention
from models.config import ModelConfig

ATTENTION_CLASSES: dict[str, type[nn.Module]] = {"softmax": SoftmaxAttention}


def build_attention(cfg: ModelConfig, layer: int, kind: str) -> nn.Module:
    if kind not in ATTENTION_CLASSES:
        raise NotImplementedError(f"attention kind {kind!r} is not available in this build")
    return ATTENTION_CLASSES[kind](cfg, layer)
