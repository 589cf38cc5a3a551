"""Model configuration: sizes, the attention kind of every layer and the MLP kind."""

from __future__ import annotations

from dataclasses import dataclass, field

class ConfigError(ValueError):
    """A config problem, stated with the key at fault and the fix."""


ATTENTION_KINDS = ("softmax", "softmax_sink", "relu", "lisa")
ATTENTION_ABBREVIATIONS = {"s": "softmax", "k": "softmax_sink", "r": "relu", "l": "lisa"}
MLP_KINDS = ("dense", "moe", "uoe")


@dataclass
class MoEConfig:
    """Shared by the top-k router MoE and Union-of-Experts layers."""

    num_experts: int = 4
    top_k: int = 2
    expert_hidden_size: int = 128  # D_e: ordinary (routed) neurons per expert
    shared_hidden_size: int = 0  # MoE: width of the shared expert (0 = none)
    routing_neurons: int = 0  # UoE: N_s per expert; 0 = shared_hidden_size // num_experts
    score: str = "h"  # UoE routing-neuron activation scored: h | silu | z
    vse_mode: str = "overlap"  # UoE virtual shared expert: overlap | disjoint
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0  # aux-loss-free balancing; 0 = off
    capacity_factor: float = 0.0  # 0 = dropless
    moe_layers: str = "all"  # "all" or comma-separated layer indices
    grouped_gemm: bool = False  # run each rank's experts as grouped GEMMs (torch._grouped_mm)


@dataclass
class ReLUAttentionConfig:
    normalizer: str = "prefix"  # none | prefix | seqlen
    block_size: int = 256  # query block for O(block x seq) memory


@dataclass
class LISAConfig:
    # Low-rank Q/K correction, rank per head; 0 = head_dim // 8 (8x fewer Q/K parameters).
    # Must be even (RoPE).
    rank: int = 0
    align_hidden: int = 16  # width of the head-alignment FFN; 0 = linear head mixing only
    # Heads mixed together by the alignment FFN; 0 = all heads. Groups never straddle tensor-parallel
    # ranks, so the group must divide num_heads / parallel.tensor.
    align_group: int = 0
    keep_full_layers: int = 2  # the first layers never share attention

    def resolved_rank(self, head_dim: int) -> int:
        return self.rank or max(2, head_dim // 8 // 2 * 2)

    def resolved_group(self, num_heads: int) -> int:
        return self.align_group or num_heads


@dataclass
class ModelConfig:
    vocab_size: int = 4096  # tokenizer vocabulary; the embedding is padded to `vocab_pad_to`
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    # Grouped-query attention: key/value heads shared by num_heads / num_kv_heads query heads each
    # (0 = num_heads, multi-head attention). Must divide num_heads and be a multiple of parallel.tensor.
    num_kv_heads: int = 0
    ffn_hidden_size: int = 352
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    vocab_pad_to: int = 128
    # One kind per layer: a list, a comma-separated string, or a compact string of letters
    # (s=softmax, k=softmax_sink, r=relu, l=lisa), e.g. "ssrl". One entry repeats for every layer.
    attention: str | list[str] = "softmax"
    mlp: str = "dense"
    moe: MoEConfig = field(default_factory=MoEConfig)
    relu_attention: ReLUAttentionConfig = field(default_factory=ReLUAttentionConfig)
    lisa: LISAConfig = field(default_factory=LISAConfig)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        pad = self.vocab_pad_to
        return (self.vocab_size + pad - 1) // pad * pad

    def attention_kinds(self) -> list[str]:
        kinds = parse_attention_pattern(self.attention, self.num_layers)
        if "lisa" in kinds:
            check_lisa(self, kinds)
        return kinds

    def mlp_kind(self, layer: int) -> str:
        if self.mlp == "dense" or self.moe.moe_layers == "all":
            return self.mlp
        wanted = {int(i) for i in str(self.moe.moe_layers).split(",") if i.strip()}
        return self.mlp if layer in wanted else "dense"


def parse_attention_pattern(pattern: str | list[str], num_layers: int) -> list[str]:
    if isinstance(pattern, str):
        if "," in pattern or pattern in ATTENTION_KINDS:
            kinds = [p.strip() for p in pattern.split(",") if p.strip()]
        else:
            unknown = sorted(set(pattern) - set(ATTENTION_ABBREVIATIONS))
            if unknown:
                raise ValueError(
                    f"model.attention={pattern!r}: unknown letters {unknown}; use a list of "
                    f"{ATTENTION_KINDS} or letters {ATTENTION_ABBREVIATIONS}"
                )
            kinds = [ATTENTION_ABBREVIATIONS[c] for c in pattern]
    else:
        kinds = list(pattern)
    if len(kinds) == 1:
        kinds = kinds * num_layers
    bad = [k for k in kinds if k not in ATTENTION_KINDS]
    if bad:
        raise ValueError(f"model.attention: unknown kinds {bad}; choose from {ATTENTION_KINDS}")
    if len(kinds) != num_layers:
        raise ValueError(
            f"model.attention lists {len(kinds)} layers but model.num_layers={num_layers}; "
            "give one kind per layer or a single kind for all"
        )
    if kinds and kinds[0] == "lisa":
        raise ValueError(
            "model.attention: layer 0 is lisa, but a lisa layer reuses the previous layer's attention "
            "scores and layer 0 has none; start with softmax, softmax_sink or relu layers"
        )
    return kinds


def check_lisa(cfg: ModelConfig, kinds: list[str]) -> None:
    """Where lisa layers may go and whether their sizes fit; raises ValueError."""
    lisa = cfg.lisa
    early = [i for i, k in enumerate(kinds[: lisa.keep_full_layers]) if k == "lisa"]
    if early:
        raise ValueError(
            f"model.attention puts lisa at layers {early}, but model.lisa.keep_full_layers="
            f"{lisa.keep_full_layers} keeps the first layers as full attention; move them later or "
            "lower keep_full_layers"
        )
    rank = lisa.resolved_rank(cfg.head_dim)
    if rank % 2 or rank < 2:
        raise ValueError(f"model.lisa.rank={lisa.rank} must be even and >= 2 (RoPE rotates pairs)")
    group = lisa.resolved_group(cfg.num_heads)
    if cfg.num_heads % group:
        raise ValueError(
            f"model.lisa.align_group={lisa.align_group} must divide model.num_heads={cfg.num_heads}"
        )
