"""Decoder-only transformer: embedding -> pre-norm blocks -> norm -> output head.

Parallel details live in the layers (megatron-core); this file reads like a textbook decoder.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import tensor_parallel
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.config import ModelConfig
from models.cross_entropy import cross_entropy_and_logsumexp
from models.layers import (
    Rotary,
    column_linear,
    normal_init,
    parallel_config,
    tp_size,
)
from models.registry import build_attention, build_mlp

CHECKPOINT_MODES = ("none", "full", "selective")


def checkpoint_mode(value: str | bool) -> str:
    """train.activation_checkpointing -> none | full | selective (true / false also accepted).

    full: each block is recomputed in the backward pass (keeps only block inputs).
    selective: only the attention core (scores, weights, attention output: the seq^2 and
    head-sized tensors) is recomputed; projections and MLPs keep their activations."""
    text = str(value).strip().lower()
    mode = {"true": "full", "1": "full", "yes": "full", "false": "none", "0": "none", "no": "none"}.get(text, text)
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"train.activation_checkpointing={value!r}: choose one of {CHECKPOINT_MODES}")
    return mode


def _outermost_with(module: nn.Module, method: str) -> list[nn.Module]:
    """The submodules defining `method` that no other such submodule contains."""
    found = []
    for child in module.children():
        found += [child] if hasattr(child, method) else _outermost_with(child, method)
    return found


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = build_attention(cfg, layer)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = build_mlp(cfg, layer)
        self.mlp_takes_mask = getattr(self.mlp, "takes_token_mask", False)  # routed MLPs: padding apart

    def forward(self, x: torch.Tensor, ctx: dict, shared_scores=None) -> torch.Tensor:
        """shared_scores: what the previous layer published, for an attention kind that reuses them.
        An argument, not left in ctx by the caller: a checkpointed block recomputed in backward
        must see its own layer's, and a compiled block then reads ctx keys that are the same in
        every layer (no guard on which layers published, so no recompilation per layer)."""
        ctx["shared_scores"] = shared_scores
        x = x + self.attn(self.attn_norm(x), ctx)
        if self.mlp_takes_mask:
            return x + self.mlp(self.mlp_norm(x), ctx.get("token_mask"))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, activation_checkpointing: str | bool = "none", z_loss: float = 0.0):
        super().__init__()
        assert cfg.padded_vocab_size % tp_size() == 0, \
            f"padded vocabulary {cfg.padded_vocab_size} at TP={tp_size()} (models.registry.validate_model)"
        self.cfg = cfg
        self._step_layers: list[nn.Module] | None = None  # see after_optimizer_step
        self.activation_checkpointing = checkpoint_mode(activation_checkpointing)
        # z-loss: z_loss x mean(logsumexp(logits)^2), keeps the softmax normaliser near 1 (bf16 stability).
        self.z_loss = z_loss
        # Detached scalars of the last training forward that the loop logs beside the loss.
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.embed = tensor_parallel.VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, init_method=normal_init(cfg.init_std), config=parallel_config()
        )
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        # With tied embeddings the head borrows the embedding's (vocab-split) weight.
        self.head = column_linear(
            cfg, cfg.hidden_size, cfg.padded_vocab_size, skip_weight_param_allocation=cfg.tie_embeddings
        )
        self._tensors_only_state_dict()

    def _tensors_only_state_dict(self) -> None:
        """megatron-core's layers report an empty (None) ``_extra_state``: state dicts leave it out
        (checkpoint converters expect tensors) and loading puts it back, so both forms load."""
        layers = [name for name, sub in self.named_modules()
                  if type(sub).get_extra_state is not nn.Module.get_extra_state]

        def drop(module, state, prefix, local_metadata):
            for key in [k for k, v in state.items() if k.endswith("_extra_state") and v is None]:
                del state[key]

        def readd(state, prefix, *args):
            for name in layers:
                state.setdefault(f"{prefix}{name + '.' if name else ''}_extra_state", None)

        self._register_state_dict_hook(drop)
        self._register_load_state_dict_pre_hook(readd)

    def compile_targets(self) -> list[nn.Module]:
        """What train.compile compiles: the blocks. A routed (MoE / UoE) block leaves its routing
        statistics, and an expert dispatch that waits for the device, to run eagerly between
        compiled parts (models.moe.experts)."""
        return list(self.blocks)

    def compile_blocks(self, **options) -> None:
        """torch.compile in place (parameter names unchanged, so checkpoints are too); options go
        to torch.compile."""
        targets = self.compile_targets()
        # Blocks share one compiled code object, with a graph per distinct layer (attention kind,
        # whether it publishes scores, how deep a LISA chain it reads): up to one per block, twice
        # that once a new sequence length recompiles them with dynamic shapes. Past dynamo's
        # default limit (8) the rest would silently run eagerly.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(targets))
        for module in targets:
            module.compile(**options)

    def hidden_states(self, tokens: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        """The final (normed) hidden states [batch, seq, hidden], whole on every tensor-parallel rank.
        ctx["token_mask"] (bool [batch, seq], optional): the real tokens of a padded batch, which
        routed MLPs count alone in their balancing, capacity and statistics."""
        ctx = {} if ctx is None else ctx
        cache = ctx.get("kv_cache")  # models.attention.kv_cache: the new tokens follow its positions
        offset = ctx["position_offset"] = cache.length if cache is not None else 0
        ctx["rotary"] = partial(self.rotary, offset=offset) if offset else self.rotary
        ctx["recompute_attention"] = self.training and self.activation_checkpointing == "selective"
        x = self.embed(tokens)
        shared = ctx["shared_scores"] = None  # every block sees the same ctx keys
        published = ctx["attention_scores"] = {}  # layer -> the scores it handed to the next layer
        for layer, block in enumerate(self.blocks):
            ctx["published_scores"] = None
            if self.training and self.activation_checkpointing == "full":
                x = checkpoint(block, x, ctx, shared, use_reentrant=False)
            else:
                x = block(x, ctx, shared)
            shared = ctx["published_scores"]
            if shared is not None:
                published[layer] = shared
            elif getattr(block.attn, "publish_scores", False):
                raise RuntimeError(f"layer {layer} ({type(block.attn).__name__}) is to hand its attention scores to "
                                   f"the LISA layer after it but published none: its core must call "
                                   "self.publish_projection(ctx, q, k) or self.publish(ctx, scores)")
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.norm(x)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden_states -> logits for this rank's vocabulary shard: [batch, seq, padded_vocab / tp]."""
        weight = self.embed.weight if self.cfg.tie_embeddings else None
        logits, _ = self.head(hidden, weight=weight)
        return logits

    def logits(self, tokens: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        """Logits for this rank's vocabulary shard: [batch, seq, padded_vocab / tp]."""
        return self.output_logits(self.hidden_states(tokens, ctx))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy plus any auxiliary (load-balancing, z) losses while training.
        document_ids [batch, seq] (models.attention.masks.document_ids): attend within documents only."""
        logits = self.logits(tokens, {"document_ids": document_ids} if document_ids is not None else None).float()
        z = None
        metrics = {}
        if self.training and self.z_loss > 0:  # one pass over the logits gives both
            ce, logsumexp = cross_entropy_and_logsumexp(logits, labels)
            loss, z = ce.mean(), self.z_loss * logsumexp.square().mean()
            metrics["z_loss"] = z.detach()
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels).mean()
        if not self.training:
            return loss
        aux = self.aux_loss()
        if z is not None or torch.is_tensor(aux):
            # The loss trained on has more parts: the cross-entropy alone compares with val/loss and
            # with models without them (train/ce_loss).
            metrics["ce_loss"] = loss.detach()
        self.last_metrics = metrics
        return loss + aux + (z if z is not None else 0.0)

    def cast_parameters(self, dtype: torch.dtype) -> "GPT":
        """The parameters in `dtype`, the buffers (RoPE tables, routers' selection bias) as they are:
        the model as DeepSpeed's mixed precision runs it (a rounded bias would send tokens near a tie
        to other experts than training did)."""
        for param in self.parameters():
            param.data = param.data.to(dtype)
        return self

    def after_optimizer_step(self, applied: bool = True) -> None:
        """Every layer's own update after an optimizer step (routed layers move their selection
        bias): the outermost submodules that define after_optimizer_step, each once, found on the
        first call. Layers may hold collectives here: every rank calls it after every step. A step
        that was not applied (train.skip_spikes; every rank decides alike) updates nothing either:
        layers that define after_skipped_step forget what the step's batch told them instead."""
        if self._step_layers is None:
            self._step_layers = _outermost_with(self, "after_optimizer_step")
        for layer in self._step_layers:
            if applied:
                layer.after_optimizer_step()
            elif hasattr(layer, "after_skipped_step"):
                layer.after_skipped_step()

    def aux_loss(self) -> torch.Tensor | float:
        losses = [b.mlp.aux_loss for b in self.blocks if getattr(b.mlp, "aux_loss", None) is not None]
        return sum(losses) if losses else 0.0
