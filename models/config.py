"""Model configuration: sizes, the attention kind of every layer and the MLP kind."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class ReLUAttentionConfig:
    normalizer: str = "prefix"  # none | prefix | seqlen
    block_size: int = 256  # query block for O(block x seq) memory


@dataclass
class LISAConfig:
    rank: int = 8  # low-rank Q/K correction
    align_hidden: int = 16  # width of the head-alignment FFN
    align_group: int = 0  # heads mixed together; 0 = all local heads
    keep_full_layers: int = 2  # the first layers never share attention


@dataclass
class ModelConfig:
    vocab_size: int = 4096  # tokenizer vocabulary; the embedding is padded to `vocab_pad_to`
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
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
    def padded_vocab_size(self) -> int:
        pad = self.vocab_pad_to
        return (self.vocab_size + pad - 1) // pad * pad

    def attention_kinds(self) -> list[str]:
        return parse_attention_pattern(self.attention, self.num_layers)

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
    return kinds
