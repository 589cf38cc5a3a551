"""Attention kinds, chosen per layer by `ModelConfig.attention`.

Every kind publishes its pre-activation scores into ctx["attention_scores"][layer] when the next
layer is a LISA layer, and its weights into ctx["attention_maps"][layer] when
ctx["capture_attention"] is set.
"""

from __future__ import annotations

from torch import nn

from models.attention.lisa import LISAAttention
from models.attention.relu import ReLUAttention
from models.attention.sink import SinkSoftmaxAttention
from models.attention.softmax import SoftmaxAttention
from models.config import ModelConfig

ATTENTION_CLASSES: dict[str, type[nn.Module]] = {
    "softmax": SoftmaxAttention,
    "softmax_sink": SinkSoftmaxAttention,
    "relu": ReLUAttention,
    "lisa": LISAAttention,
}


def lisa_source_kind(kinds: list[str], layer: int) -> str:
    """The nearest earlier non-LISA kind: whose attention function a LISA layer keeps."""
    for kind in reversed(kinds[:layer]):
        if kind != "lisa":
            return kind
    raise ValueError(f"LISA layer {layer} has no earlier full attention layer")


def build_attention(cfg: ModelConfig, layer: int, kind: str) -> nn.Module:
    if kind not in ATTENTION_CLASSES:
        raise NotImplementedError(f"attention kind {kind!r} is not available in this build")
    kinds = cfg.attention_kinds()
    if kind == "lisa":
        module = LISAAttention(cfg, layer, lisa_source_kind(kinds, layer))
    else:
        module = ATTENTION_CLASSES[kind](cfg, layer)
    module.publish_scores = layer + 1 < len(kinds) and kinds[layer + 1] == "lisa"
    return module
