"""Parameter counts and training FLOPs per token, from the config alone (for MFU and planning);
each kind declares its own terms (models.registry)."""

from __future__ import annotations

from models.config import ModelConfig
from models.registry import attention_kind, mlp_kind


def attention_params(cfg: ModelConfig, kind: str) -> int:
    return attention_kind(kind).params(cfg)


def mlp_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP."""
    return mlp_kind(cfg.mlp_kind(layer)).params(cfg)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    d, vocab = cfg.hidden_size, cfg.padded_vocab_size
    embedding = vocab * d
    head = 0 if cfg.tie_embeddings else vocab * d
    norms = (2 * cfg.num_layers + 1) * d
    attn = sum(attention_params(cfg, k) for k in cfg.attention_kinds())
    mlps = [mlp_params(cfg, i) for i in range(cfg.num_layers)]
    total = embedding + head + norms + attn + sum(t for t, _ in mlps)
    active = embedding + head + norms + attn + sum(a for _, a in mlps)
    return {"total": total, "active": active, "embedding": embedding,
            "active_non_embedding": active - embedding, "norms": norms}


def score_flops(cfg: ModelConfig, kind: str, seq: int) -> float:
    """Training FLOPs per token of one layer's score and value products: a kind's own count, else
    Megatron's 12 x hidden x seq."""
    own = attention_kind(kind).score_flops
    return own(cfg, seq) if own is not None else 12.0 * cfg.hidden_size * seq


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (the output head included, the
    embedding lookup and the norms' weights not) + every layer's score FLOPs (Megatron's formula
    unless a kind says otherwise)."""
    seq = seq_len or cfg.max_seq_len
    counts = param_counts(cfg)
    tied_head = cfg.padded_vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0
    matmul = counts["active_non_embedding"] - counts["norms"] + tied_head
    return 6.0 * matmul + sum(score_flops(cfg, kind, seq) for kind in cfg.attention_kinds())


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of the routed experts (sharded by expert parallelism); the rest is dense."""
    total = 0
    for layer in range(cfg.num_layers):
        own = mlp_kind(cfg.mlp_kind(layer)).expert_params
        total += own(cfg) if own is not None else 0
    return total
