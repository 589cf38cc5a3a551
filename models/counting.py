"""Parameter counts and training FLOPs per token, from the config alone (for MFU and planning)."""

from __future__ import annotations

from models.config import ModelConfig


def attention_params(cfg: ModelConfig, kind: str) -> int:
    d = cfg.hidden_size
    if kind == "lisa":
        from models.attention.lisa import lisa_param_count

        return lisa_param_count(cfg)
    extra = cfg.num_heads if kind == "softmax_sink" else 0
    return 2 * d * d + 2 * d * cfg.kv_width + extra


def mlp_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP."""
    d, kind, moe = cfg.hidden_size, cfg.mlp_kind(layer), cfg.moe
    if kind == "dense":
        n = 3 * d * cfg.ffn_hidden_size
        return n, n
    experts = moe.num_experts * 3 * d * moe.expert_hidden_size
    active_experts = moe.top_k * 3 * d * moe.expert_hidden_size
    if kind == "moe":
        shared = 3 * d * moe.shared_hidden_size
        router = d * moe.num_experts
        return router + shared + experts, router + shared + active_experts
    routing = moe.routing_neurons or moe.shared_hidden_size // moe.num_experts
    vse = 3 * d * moe.num_experts * routing
    return vse + experts, vse + active_experts


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
            "active_non_embedding": active - embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (the output head included, the
    embedding lookup not) + 12 x layers x hidden x seq for attention scores (Megatron's formula)."""
    seq = seq_len or cfg.max_seq_len
    counts = param_counts(cfg)
    matmul = counts["active_non_embedding"] + (cfg.padded_vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0)
    return 6.0 * matmul + 12.0 * cfg.num_layers * cfg.hidden_size * seq


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of the routed experts (sharded by expert parallelism); the rest is dense."""
    moe = cfg.moe
    per_layer = moe.num_experts * 3 * cfg.hidden_size * moe.expert_hidden_size
    return sum(per_layer for i in range(cfg.num_layers) if cfg.mlp_kind(i) != "dense")
