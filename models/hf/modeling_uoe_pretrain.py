"""Hugging Face modeling code for uoe-pretrain models that have no standard transformers
architecture: Union-of-Experts and top-k router MoE MLPs, and hybrid softmax / softmax_sink /
relu / LISA attention. `python -m tools.export` copies this file into the exported folder:

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

It depends on PyTorch and transformers only and computes what the training code computes (same
parameter layouts, fp32 routing, same attention weights); see the framework's models/ for the
derivations. Inference notes:
* KV cache (transformers' DynamicCache): softmax / sink / relu layers cache rotated keys and values,
  LISA layers their rank-r keys and values (the previous layer's scores for the new rows are
  recomputed from its cache). Models with relu_normalizer "seqlen" do not cache: that normaliser
  changes every earlier row when the sequence grows, so each step reruns the whole sequence;
* padding must be on the right (causal attention then leaves the real tokens' logits unchanged,
  except with relu_normalizer "seqlen", whose normaliser counts the padded length: score such a
  model one sequence at a time); generate() takes prompts without padding (one prompt, or prompts
  of one length: lm-eval's generate_until with --batch_size 1);
* MoE / UoE layers are dropless: a training capacity factor is not applied.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

ATTENTION_KINDS = ("softmax", "softmax_sink", "relu", "lisa")
MLP_KINDS = ("dense", "moe", "uoe")


class UoEPretrainConfig(PretrainedConfig):
    model_type = "uoe_pretrain"

    def __init__(self, vocab_size: int = 4096, hidden_size: int = 128, num_hidden_layers: int = 2,
                 num_attention_heads: int = 4, intermediate_size: int = 352, max_position_embeddings: int = 256,
                 rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5, initializer_range: float = 0.02,
                 attention_kinds: list[str] | None = None, lisa_sources: list[str | None] | None = None,
                 relu_normalizer: str = "prefix", lisa_rank: int = 2, lisa_align_group: int = 0,
                 lisa_align_hidden: int = 16, mlp_kinds: list[str] | None = None, num_experts: int = 4,
                 num_experts_per_tok: int = 2, expert_hidden_size: int = 128, shared_hidden_size: int = 0,
                 routing_neurons: int = 0, uoe_score: str = "h", vse_mode: str = "overlap",
                 tie_word_embeddings: bool = False, use_cache: bool = True,
                 num_key_value_heads: int | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads  # grouped-query attention
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_kinds = list(attention_kinds or ["softmax"] * num_hidden_layers)
        # For every LISA layer, the attention function it keeps (nearest earlier non-LISA kind).
        self.lisa_sources = list(lisa_sources or [None] * num_hidden_layers)
        self.relu_normalizer = relu_normalizer
        self.lisa_rank = lisa_rank
        self.lisa_align_group = lisa_align_group or num_attention_heads
        self.lisa_align_hidden = lisa_align_hidden
        self.mlp_kinds = list(mlp_kinds or ["dense"] * num_hidden_layers)
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok  # top-k ("top_k" is a sampling setting in transformers)
        self.expert_hidden_size = expert_hidden_size  # routed width per expert (UoE: besides routing neurons)
        self.shared_hidden_size = shared_hidden_size
        self.routing_neurons = routing_neurons
        self.uoe_score = uoe_score
        self.vse_mode = vse_mode
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# ---------------------------------------------------------------------------------- attention


def rope_tables(dim: int, start: int, end: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [end - start, dim / 2] for positions start..end-1: float32 angles, like the training code
    (and transformers' Llama)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = torch.outer(torch.arange(start, end, dtype=torch.int64).float(), inv_freq)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Half-split (Llama) rotary embedding of x [batch, heads, seq, dim]."""
    cos, sin = (t.to(x.dtype) for t in table)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_mask(scores: torch.Tensor) -> torch.Tensor:
    """[q, k] booleans for scores [.., q, k] whose queries are the last q of the k positions."""
    q, k = scores.shape[-2:]
    rows = torch.arange(k - q, k, device=scores.device).unsqueeze(1)
    return torch.arange(k, device=scores.device).unsqueeze(0) <= rows


def softmax_weights(scores: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~causal_mask(scores), float("-inf")).softmax(-1)


def sink_softmax_weights(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax with a per-head sink logit in the denominator; weights on the real keys only."""
    b, h, q, _ = scores.shape
    sink_col = sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, q, 1)
    masked = scores.masked_fill(~causal_mask(scores), float("-inf"))
    return torch.cat([sink_col, masked], dim=-1).softmax(-1)[..., 1:]


def relu_weights(scores: torch.Tensor, normalizer: str) -> torch.Tensor:
    """ReLU(s_ij) / n_i on visible keys; n_i = 1 (none), i + 1 (prefix: keys query i sees),
    max(i, 1) (content: those keys but the first) or the sequence length (seqlen)."""
    q, k = scores.shape[-2:]
    if normalizer == "none":
        n = torch.ones(q, 1, device=scores.device)
    elif normalizer in ("prefix", "content"):
        n = torch.arange(k - q + 1, k + 1, device=scores.device, dtype=torch.float32).unsqueeze(1)
        if normalizer == "content":
            n = (n - 1).clamp(min=1)
    elif normalizer == "seqlen":
        n = torch.full((q, 1), float(k), device=scores.device)
    else:
        raise ValueError(f"relu_normalizer={normalizer!r}: expected none, prefix, content or seqlen")
    return scores.relu().masked_fill(~causal_mask(scores), 0.0) / n.to(scores.dtype)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [batch, heads, s, w] @ b [batch, kv_heads, w, t] -> [batch, heads, s, t]: query head j reads
    K/V head j // (heads / kv_heads); the rows of a K/V head's queries are stacked, so b is not
    copied per head."""
    batch, heads, s, width = a.shape
    kv = b.shape[1]
    return (a.reshape(batch, kv, heads // kv * s, width) @ b).reshape(batch, heads, s, b.shape[-1])


class Attention(nn.Module):
    """softmax, softmax_sink or relu attention over a fused QKV projection grouped by K/V head
    (rows [kv_head, q_1..q_g|k|v, head_dim], g = heads / kv_heads)."""

    def __init__(self, config: UoEPretrainConfig, layer: int, kind: str, keep_scores: bool):
        super().__init__()
        self.layer, self.kind = layer, kind
        self.keep_scores = keep_scores  # the next layer is LISA and reuses these scores
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.normalizer = config.relu_normalizer
        qkv_width = config.hidden_size + 2 * self.kv_heads * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_width, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if kind == "softmax_sink":
            self.sink = nn.Parameter(torch.zeros(self.heads))

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        b, s, _ = x.shape
        g = self.heads // self.kv_heads
        qkv = self.qkv(x).view(b, s, self.kv_heads, g + 2, self.head_dim)
        q = qkv[:, :, :, :g].flatten(2, 3).transpose(1, 2)
        k, v = (qkv[:, :, :, i].transpose(1, 2) for i in (g, g + 1))
        q, k = apply_rope(q, state["rope"]), apply_rope(k, state["rope"])
        if state["cache"] is not None:  # the cache holds the K/V heads only
            k, v = state["cache"].update(k, v, self.layer)
        if self.kind == "softmax" and not self.keep_scores and k.shape[-2] == s:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
        else:
            scores = grouped_matmul(q / math.sqrt(self.head_dim), k.transpose(-2, -1))
            state["scores"] = scores
            if self.kind == "softmax":
                weights = softmax_weights(scores)
            elif self.kind == "softmax_sink":
                weights = sink_softmax_weights(scores, self.sink)
            else:
                weights = relu_weights(scores, self.normalizer)
            o = grouped_matmul(weights.to(v.dtype), v)
        return self.out(o.transpose(1, 2).flatten(2))


class HeadAlign(nn.Module):
    """Pointwise FFN over the head axis within groups of heads: M S + W2 GELU(W1 S + b1) + b2."""

    ROW_BLOCK = 256

    def __init__(self, heads: int, group: int, hidden: int):
        super().__init__()
        groups = heads // group
        self.group, self.hidden = group, hidden
        self.mix = nn.Parameter(torch.eye(group).expand(groups, group, group).clone())
        if hidden:
            self.w1 = nn.Parameter(torch.zeros(groups, hidden, group))
            self.b1 = nn.Parameter(torch.zeros(groups, hidden))
            self.w2 = nn.Parameter(torch.zeros(groups, group, hidden))
            self.b2 = nn.Parameter(torch.zeros(groups, group))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        """Each group's heads are the rows of a matrix [group, q * k]: small matmuls, no permute."""
        b, h, sq, sk = scores.shape
        s = scores.reshape(b, h // self.group, self.group, sq, sk)
        out = (self.mix.to(s.dtype) @ s.flatten(3)).view(s.shape)
        if self.hidden:
            w1, b1, w2, b2 = (p.to(s.dtype) for p in (self.w1, self.b1, self.w2, self.b2))
            parts = []
            for start in range(0, sq, self.ROW_BLOCK):  # bounds the hidden activations' memory
                rows = s[:, :, :, start:start + self.ROW_BLOCK]
                hid = F.gelu(w1 @ rows.flatten(3) + b1[..., None])
                parts.append((w2 @ hid + b2[..., None]).view(rows.shape))
            out = out + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=3))
        return out.view(b, h, sq, sk)


class LISAAttention(nn.Module):
    """Reuses the previous layer's scores: HeadAlign(S_prev) + (X Wq_r)(X Wk_r)^T / sqrt(r), with
    RoPE on the rank-r projections (rows [head, q|k, r]); V (K/V heads) and the output projection
    are full."""

    def __init__(self, config: UoEPretrainConfig, layer: int, source_kind: str):
        super().__init__()
        self.layer = layer
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = d // self.heads
        self.rank = config.lisa_rank
        self.source_kind = source_kind
        self.normalizer = config.relu_normalizer
        self.qk = nn.Linear(d, 2 * self.heads * self.rank, bias=False)
        self.v = nn.Linear(d, config.num_key_value_heads * self.head_dim, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.align = HeadAlign(self.heads, config.lisa_align_group, config.lisa_align_hidden)

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, self.heads, 2, self.rank).permute(3, 0, 2, 1, 4).unbind(0)
        table = state["rope_lisa"]
        q, k = apply_rope(q, table), apply_rope(k, table)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if state["cache"] is not None:
            k, v = state["cache"].update(k, v, self.layer)
        delta = (q @ k.transpose(-2, -1)) / math.sqrt(self.rank)
        scores = self.align(state["scores"].to(delta.dtype)) + delta
        state["scores"] = scores
        weights = relu_weights(scores, self.normalizer) if self.source_kind == "relu" else softmax_weights(scores)
        return self.out(grouped_matmul(weights.to(v.dtype), v).transpose(1, 2).flatten(2))


# ---------------------------------------------------------------------------------- MLPs


class SwiGLU(nn.Module):
    """Gate and up rows interleave: w_in rows (gate_0, up_0, gate_1, up_1, ...)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w_in = nn.Linear(hidden, 2 * width, bias=False)
        self.w_out = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_in(x).unflatten(-1, (-1, 2))
        return self.w_out(F.silu(gate_up[..., 0]) * gate_up[..., 1])


class Experts(nn.Module):
    """N SwiGLU experts with stacked weights: w_in [N, 2 * width, d] (interleaved), w_out [N, d, width]."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.zeros(num_experts, 2 * width, hidden))
        self.w_out = nn.Parameter(torch.zeros(num_experts, hidden, width))

    def forward(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y[t] = sum_k weights[t, k] * expert_{selected[t, k]}(x[t]); x [T, d]."""
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            token, slot = (selected == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate_up = F.linear(x[token], self.w_in[e]).unflatten(-1, (-1, 2))
            y = F.linear(F.silu(gate_up[..., 0]) * gate_up[..., 1], self.w_out[e])
            out.index_add_(0, token, y * weights[token, slot].to(y.dtype).unsqueeze(-1))
        return out


def top_k(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection on scores + bias (the bias only picks experts); weights = softmax over the
    selected unbiased scores, in fp32."""
    selected = (scores + bias.float()).topk(k, dim=-1).indices
    return selected, torch.softmax(scores.gather(-1, selected), dim=-1)


class RouterMoE(nn.Module):
    """Learned fp32 linear router over log-softmax scores, routed experts, optional shared expert."""

    def __init__(self, config: UoEPretrainConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("router_bias", torch.zeros(config.num_experts))
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_hidden_size)
        self.shared = SwiGLU(config.hidden_size, config.shared_hidden_size) if config.shared_hidden_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.log_softmax(F.linear(x.float(), self.router.float()), dim=-1)
        selected, weights = top_k(scores, self.router_bias, self.top_k)
        y = self.experts(x, selected, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)


class UnionOfExperts(nn.Module):
    """Experts score tokens by the L2 norm of their own routing neurons (fp32); the routing neurons
    of all experts form the virtual shared expert (VSE), whose neuron j belongs to expert
    j // routing_neurons. vse_mode overlap scales a selected expert's routing neurons by 1 + w."""

    def __init__(self, config: UoEPretrainConfig):
        super().__init__()
        n, ns = config.num_experts, config.routing_neurons
        self.top_k, self.routing_neurons = config.num_experts_per_tok, ns
        self.score, self.vse_mode = config.uoe_score, config.vse_mode
        self.vse_in = nn.Linear(config.hidden_size, 2 * n * ns, bias=False)
        self.vse_out = nn.Linear(n * ns, config.hidden_size, bias=False)
        self.register_buffer("router_bias", torch.zeros(n))
        self.experts = Experts(n, config.hidden_size, config.expert_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, n = x.shape[0], self.router_bias.numel()
        gate_up = self.vse_in(x).unflatten(-1, (-1, 2))
        z = gate_up[..., 0]
        h = F.silu(z) * gate_up[..., 1]
        a = {"h": h, "silu": F.silu(z), "z": z}[self.score]
        # an expert's routing neurons are consecutive
        sq = a.float().pow(2).view(tokens, n, self.routing_neurons).sum(-1)
        scores = torch.sqrt(sq + 1e-6)
        selected, weights = top_k(scores, self.router_bias, self.top_k)
        if self.vse_mode == "overlap":
            scale = torch.ones_like(scores).scatter_add(1, selected, weights).to(h.dtype)
            h = (h.view(tokens, n, self.routing_neurons) * scale[..., None]).view(h.shape)
        return (self.vse_out(h) + self.experts(x, selected, weights)).view(shape)


# ---------------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, config: UoEPretrainConfig, layer: int):
        super().__init__()
        kinds = config.attention_kinds
        kind = kinds[layer]
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if kind == "lisa":
            self.attn = LISAAttention(config, layer, config.lisa_sources[layer])
        else:
            keep = layer + 1 < len(kinds) and kinds[layer + 1] == "lisa"
            self.attn = Attention(config, layer, kind, keep)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        mlp = config.mlp_kinds[layer]
        if mlp == "uoe":
            self.mlp = UnionOfExperts(config)
        elif mlp == "moe":
            self.mlp = RouterMoE(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), state)
        return x + self.mlp(self.mlp_norm(x))


class UoEPretrainPreTrainedModel(PreTrainedModel):
    config_class = UoEPretrainConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Experts):
            nn.init.normal_(module.w_in, mean=0.0, std=std)
            nn.init.normal_(module.w_out, mean=0.0, std=std)
        elif isinstance(module, RouterMoE):
            nn.init.normal_(module.router, mean=0.0, std=std)


class UoEPretrainModel(UoEPretrainPreTrainedModel):
    def __init__(self, config: UoEPretrainConfig):
        super().__init__(config)
        for name, kinds, allowed in (("attention_kinds", config.attention_kinds, ATTENTION_KINDS),
                                     ("mlp_kinds", config.mlp_kinds, MLP_KINDS)):
            if len(kinds) != config.num_hidden_layers or set(kinds) - set(allowed):
                raise ValueError(f"config.{name}={kinds}: need {config.num_hidden_layers} entries of {allowed}")
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # relu "seqlen" divides every row by the current length: earlier rows change as the sequence
        # grows, so cached keys/values of later layers would be stale.
        self.cacheable = not (config.relu_normalizer == "seqlen" and "relu" in config.attention_kinds)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def forward(self, input_ids: torch.LongTensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """Final hidden states of input_ids, which follow the cache's positions (if any)."""
        cfg = self.config
        start = cache.get_seq_length() if cache is not None else 0
        end = start + input_ids.shape[1]
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        state = {"cache": cache, "rope": rope_tables(head_dim, start, end, cfg.rope_theta, input_ids.device)}
        if "lisa" in cfg.attention_kinds:
            state["rope_lisa"] = rope_tables(cfg.lisa_rank, start, end, cfg.rope_theta, input_ids.device)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, state)
        return self.norm(x)


def check_cache(past_key_values) -> None:
    if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
        raise TypeError(f"past_key_values is a {type(past_key_values).__name__}; this model reads and extends a "
                        "transformers DynamicCache: pass the one its last output returned (not a legacy tuple)")


class UoEPretrainForCausalLM(UoEPretrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: UoEPretrainConfig):
        super().__init__(config)
        self.model = UoEPretrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, past_key_values: DynamicCache | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None,
                **kwargs) -> CausalLMOutputWithPast | tuple:
        if input_ids is None:
            raise ValueError("input_ids are required (inputs_embeds are not supported)")
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attention_mask has padding before real tokens; this model supports right padding "
                             "only (tokenizer.padding_side = 'right')")
        check_cache(past_key_values)
        if not self.model.cacheable and past_key_values is not None and past_key_values.get_seq_length():
            raise ValueError("this model does not cache (relu_normalizer 'seqlen'); pass the whole sequence "
                             "without past_key_values")
        # A cache passed in holds the tokens before input_ids: it is read (and extended) whatever
        # use_cache says, which decides only whether a new one starts.
        cache = past_key_values if self.model.cacheable else None
        if cache is None and self.model.cacheable and (use_cache if use_cache is not None else self.config.use_cache):
            cache = DynamicCache()
        logits = self.lm_head(self.model(input_ids, cache))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values=None, attention_mask=None,
                                      use_cache: bool | None = None, **kwargs) -> dict:
        """Only the tokens the cache has not seen (all of them when the model does not cache)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("generate() got padded prompts, which this model cannot continue (new tokens would "
                             "follow the padding): generate one prompt at a time, or prompts of one length "
                             "(lm-eval: --batch_size 1)")
        check_cache(past_key_values)
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if not self.model.cacheable:
            past_key_values, cached = None, 0
        return {"input_ids": input_ids[:, cached:], "attention_mask": attention_mask,
                "past_key_values": past_key_values, "use_cache": use_cache}
