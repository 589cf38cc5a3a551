"""LISA layer: share the previous layer's attention scores instead of computing full Q/K.

For the H scores S^{l-1}[:, :, i, j] of the previous layer (pre-activation logits, read from
ctx["shared_scores"]) a tiny head-alignment FFN, applied pointwise over the head
axis within groups of `model.lisa.align_group` heads, gives new per-head scores:

    S_hat = M S + W2 GELU(W1 S + b1) + b2          (M: g x g, identity at init; W2, b2: zero at init)

(model.lisa.align_hidden = 0 keeps only the linear head mixing M S, the cheap variant)

and a low-rank per-head correction with RoPE adds the layer-wise difference:

    S = S_hat + (X Wq_r)(X Wk_r)^T / sqrt(r)        (rank r per head; Wk_r zero at init)

V (with its K/V heads under grouped-query attention) and the output projection are kept. The
attention function follows the nearest earlier layer that computes its own scores (its kind's
score_family): ReLU (same normaliser) after a relu layer, plain softmax after softmax or softmax_sink
layers (the sink logit is not shared). Q/K parameters shrink by head_dim / r (8x at the default
rank). Groups never straddle tensor-parallel ranks, so the group must divide the local heads
(num_heads / parallel.tensor).

Scores arrive as query/key features (models.attention.shared_scores), so the layer they come from
keeps its fused kernel. With model.lisa.kernel=auto (or torch) no layer keeps seq^2 tensors for backward:
- Linear head mixing (align_hidden 0): the whole score is such a feature product and the layer
  attends with the memory-efficient kernels (after relu layers the Triton ReLU kernels on a GPU,
  which take queries and keys wider than the values up to 256 once padded; wider, the blocked
  PyTorch path). The feature width is (distinct keys per alignment group) x head_dim + rank, so it
  costs about a softmax layer when the alignment group lies within a K/V group (grouped-query
  attention) and g times more QK work without (on an H200 at the 1B hybrid width, 4.7x / 12.9x a
  softmax layer at 2048 / 4096). On a GPU a LISA layer right after a full layer runs the fused
  kernel below instead: where a group reads several key heads, the kernel mixes the group's
  products (one product per head); where one key head serves the group, the queries are mixed
  first and the kernel takes each head alone, as flash attention does (features would need the
  low-rank keys beside the shared key per query head, and the values padded to their width). The
  second LISA layer of a chain runs the kernel too, on the first one's mixed queries and keys with
  its low-rank term added first, where those keys fit the kernel's width.
- The FFN alignment is non-linear in the scores. It, and linear alignment whose groups do not line
  up with the K/V groups, build the scores a block of model.lisa.block_size query rows at a time
  (source rows, alignment, low-rank term, weights, values) and recompute each block in backward.
  The layer hands its own scores on lazily (AlignedScores), so a following LISA layer builds them
  by rows too (rebuilding this layer's rows for each of its blocks: a chain of n such layers aligns
  the first one's rows n times), or, with model.lisa.keep_chain_scores, keeps the rows it built
  (KeptRows: about heads x seq^2 / 2 per sequence until backward) and hands those on.
  On a GPU (kernel=auto) such a layer runs as one Triton kernel instead, forward and backward
  (kernels/lisa_flash_triton.py): flash attention over scores built tile by tile from the source's
  features, the alignment and the low-rank term, for alignment groups of up to four heads and a
  source that is a layer's own projections or one LISA layer reading them (a chain of two: the
  kernel rebuilds the first alignment's tiles; no rows are kept). Elsewhere on a GPU (longer
  chains, larger groups) the FFN alignment of each block runs as one Triton kernel
  (kernels/lisa_align_triton.py). kernel=torch keeps the PyTorch paths.
kernel=naive builds the explicit scores [batch, heads, seq, seq]: the reference for both.
Decoding one token after cached keys, the layer before hands over its explicit new score row
(built once, for itself and this layer: ProjectedAttention.explicit), and this layer aligns it: on
a GPU in one fused kernel (kernels/lisa_decode_triton.py), the PyTorch path staying the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import registry
from models.attention.base import ProjectedAttention, expand_kv, local_heads, projected_activations
from models.attention.flex import block_mask_for
from models.attention.kernels import LISA_FLASH_MAX_GROUP, LISA_FLASH_MAX_WIDTH
from models.attention.relu import NORMALIZERS as RELU_NORMALIZERS
from models.attention.relu import relu_attend, relu_normaliser, relu_weights, reuses_relu_scores
from models.attention.shared_scores import (
    RowCut,
    SharedScores,
    cut_prefix,
    cut_rows,
    explicit_scores,
    grouped_matmul,
    groups_line_up,
    row_blocks,
)
from models.attention.softmax import causal_softmax, softmax_attention
from models.config import ConfigError, ModelConfig
from models.layers import Rotary, column_linear, row_linear
from models.triton_launch import triton_interpreted


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
    # auto: linear alignment attends over the shared scores as features, the FFN alignment builds
    # them by query blocks (no seq^2 tensors either way); on a GPU one fused kernel
    # (kernels/lisa_flash_triton.py) runs a LISA layer right after a full one and the second of a
    # chain (else the FFN alignment of each block, and decoding, run as fused kernels); torch: the
    # same without Triton kernels; naive: always the explicit scores.
    kernel: str = "auto"
    # Query rows per block: of the scores when kernel=auto builds them by blocks, and of the FFN's
    # hidden layer on explicit scores. 128 rather than 256: less of the diagonal block's masked half
    # aligned, and a block's scores closer to cache (bench/results/attention_speed_h1024_blocks.json).
    block_size: int = 128
    # A LISA layer followed by another keeps the score rows it builds by blocks (about
    # heads x seq^2 / 2 per sequence, until backward) and hands them on: the next layer reads them
    # instead of rebuilding this layer's alignment for each of its blocks. Where the fused kernel
    # runs a chain's first two layers (on a GPU), it keeps nothing; a third layer's rows are kept.
    keep_chain_scores: bool = False

    def resolved_rank(self, head_dim: int) -> int:
        return self.rank or max(2, head_dim // 8 // 2 * 2)

    def resolved_group(self, num_heads: int) -> int:
        return self.align_group or num_heads


KERNELS = ("auto", "torch", "naive")

registry.register_section("lisa", LISAConfig, training_only=("kernel", "block_size", "keep_chain_scores"))


def lisa_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(rank per head, alignment group, alignment hidden width)."""
    return cfg.lisa.resolved_rank(cfg.head_dim), cfg.lisa.resolved_group(cfg.num_heads), cfg.lisa.align_hidden


def lisa_align_params(cfg: ModelConfig) -> int:
    _, g, hid = lisa_sizes(cfg)
    return cfg.num_heads // g * (g * g + (2 * g * hid + hid + g if hid else 0))


def lisa_param_count(cfg: ModelConfig) -> int:
    """Parameters of one LISA layer (exact for LISAAttention)."""
    d = cfg.hidden_size
    rank, _, _ = lisa_sizes(cfg)
    return 2 * cfg.num_heads * rank * d + d * cfg.kv_width + d * d + lisa_align_params(cfg)


def lisa_score_flops(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token of one LISA layer's score and value products, counted as Megatron
    counts a softmax layer's (every key; backward twice the forward): per head and key the rank-r
    query-key product, the alignment of the scores (the group's mixing weights, and the FFN's two
    layers), and per key the weights times the values. The source's products it reads are the
    source layer's (a kernel that recomputes them does more work than the model needs)."""
    rank, group, hidden = lisa_sizes(cfg)
    per_key = cfg.num_heads * (2 * rank + 2 * group + 4 * hidden) + 2 * cfg.hidden_size
    return 3.0 * per_key * seq


def qk_compression(cfg: ModelConfig) -> float:
    """Full attention's Q/K parameters divided by a LISA layer's (head_dim / rank without
    grouped-query attention)."""
    rank, _, _ = lisa_sizes(cfg)
    return (cfg.hidden_size + cfg.kv_width) / (2 * cfg.num_heads * rank)


def chain_depths(kinds: list[str]) -> list[int]:
    """Per layer, how many LISA layers in a row end at it (0: a full layer; 1: a LISA layer right
    after a full one)."""
    depths, depth = [], 0
    for kind in kinds:
        depth = depth + 1 if kind == "lisa" else 0
        depths.append(depth)
    return depths


def keys_per_group(cfg: ModelConfig) -> int:
    """Distinct K/V heads an alignment group reads (1 where one serves the whole group)."""
    _, group, _ = lisa_sizes(cfg)
    return max(1, group // (cfg.num_heads // cfg.kv_heads))


def feature_width(cfg: ModelConfig, depth: int) -> int:
    """Width of the score features a LISA layer at this chain depth attends over with linear
    alignment: (distinct keys per alignment group) x head_dim + rank, and group x rank more for each
    LISA layer before it in the chain (its low-rank keys, side by side per group)."""
    rank, group, _ = lisa_sizes(cfg)
    return keys_per_group(cfg) * cfg.head_dim + rank + group * rank * (depth - 1)


def lisa_activations(cfg: ModelConfig, layout: registry.ActivationLayout) -> float:
    """Elements per token kept for backward, the mean over the LISA layers. Naive kernel: the
    explicit scores. Linear alignment with groups that line up with the K/V groups
    (SharedScores.mixable): the score features (queries and keys of feature_width per head) under
    fused kernels, except where the fused LISA kernel runs (fused_depth). It, and scores built
    by query blocks: the inputs only, the source layer's scaled queries among them (and, where the
    kernel takes them mixed, the mixed ones too; a chain's second layer, the first one's mixed
    queries and keys where they were not kept already)."""
    if cfg.lisa.kernel == "naive":
        return projected_activations(cfg, layout, stores_scores=True)
    hidden, t = cfg.hidden_size, layout.tensor
    inputs_only = projected_activations(cfg, layout, stores_scores=False)
    if builds_by_rows(cfg):
        return inputs_only + hidden / t
    keys, fused = keys_per_group(cfg), fused_depth(cfg, layout)
    kept = {1: inputs_only + (1 if keys > 1 else 2) * hidden / t,  # the scaled (and mixed) queries
            2: inputs_only + ((keys * hidden + cfg.kv_width) / t if keys > 1 else 0.0)}
    over_features = projected_activations(cfg, layout, stores_scores=not layout.flash)
    depths = [depth for depth in chain_depths(cfg.attention_kinds()) if depth]
    features = {depth: over_features + 2 * cfg.num_heads * feature_width(cfg, depth) / t for depth in depths}
    total = sum(kept[depth] if depth <= fused else features[depth] for depth in depths)
    return total / max(1, len(depths))


def fused_depth(cfg: ModelConfig, layout: registry.ActivationLayout) -> int:
    """How deep into a chain of LISA layers the fused kernel runs, as LISAAttention.flash decides on
    a GPU in bf16 / fp16: 0 nowhere; 1 right after a full layer; 2 also the second layer of a chain.
    Scores built by query blocks (builds_by_rows): both, for groups up to LISA_FLASH_MAX_GROUP heads
    (the second layer rebuilding the first one's alignment). Linear alignment over score features:
    the first, for groups that read several key heads up to LISA_FLASH_MAX_GROUP heads and for
    groups within one key head of any size (their queries mixed first); the second too, on the first
    one's mixed queries and keys, where they fit the kernel (groups up to LISA_FLASH_MAX_GROUP heads,
    keys side by side up to LISA_FLASH_MAX_WIDTH wide). tests/test_lisa_flash_kernel.py checks the
    model's kernel calls against it."""
    rank, group, _ = lisa_sizes(cfg)
    if not (layout.flash and cfg.lisa.kernel == "auto" and max(cfg.head_dim, rank) <= LISA_FLASH_MAX_WIDTH):
        return 0
    if builds_by_rows(cfg):
        return 2 if group <= LISA_FLASH_MAX_GROUP else 0
    if group > LISA_FLASH_MAX_GROUP:  # only where one key head serves the group (queries mixed first)
        return 1 if (cfg.num_heads // cfg.kv_heads) % group == 0 else 0
    return 2 if keys_per_group(cfg) * cfg.head_dim <= LISA_FLASH_MAX_WIDTH else 1


def builds_by_rows(cfg: ModelConfig) -> bool:
    """Whether kernel=auto / torch builds the LISA scores by query blocks (the FFN alignment, or groups
    that do not line up with the K/V groups) rather than attending over score features."""
    _, group, _ = lisa_sizes(cfg)
    return bool(cfg.lisa.align_hidden) or not groups_line_up(cfg.num_heads // cfg.kv_heads, group)


def chained_lisa_layers(kinds: list[str]) -> list[int]:
    """The LISA layers another LISA layer follows (what keep_chain_scores keeps the scores of)."""
    depths = chain_depths(kinds)
    return [i for i, (depth, next_depth) in enumerate(zip(depths, depths[1:])) if depth and next_depth]


def lisa_handed_on(cfg: ModelConfig, layout: registry.ActivationLayout) -> float:
    """Elements per token a LISA layer keeps for the next one: with keep_chain_scores, where the
    scores are built by query blocks, the kept rows of each LISA layer a LISA layer follows; the
    mean over the LISA layers, so the planner's sum over layers is exact. On a GPU the fused kernel
    runs the first two layers of a chain (fused_depth) and keeps no rows: only layers from the third
    on (built by query blocks) keep theirs, for a fourth and later."""
    if not (cfg.lisa.keep_chain_scores and cfg.lisa.kernel != "naive" and builds_by_rows(cfg)):
        return 0.0
    kinds, fused = cfg.attention_kinds(), fused_depth(cfg, layout)
    depths = chain_depths(kinds)
    chained = len([i for i in chained_lisa_layers(kinds) if depths[i] > fused]) / kinds.count("lisa")
    return chained * cfg.num_heads / layout.tensor * kept_rows_per_token(layout.seq, cfg.lisa.block_size)


def _split_param(full: torch.Tensor, local: int) -> nn.Parameter:
    rank = ps.get_tensor_model_parallel_rank()
    param = nn.Parameter(full[rank * local:(rank + 1) * local].clone())
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


HIDDEN_PIECE_BYTES = 2 << 20  # the head-alignment FFN's hidden activations per piece on CPU: about a core's L2


class HeadAlign(nn.Module):
    """Pointwise FFN over the head axis, one per group of g heads (this rank's groups only)."""

    def __init__(self, num_heads: int, local_heads: int, group: int, hidden: int, row_block: int = 256,
                 fused: bool = False):
        super().__init__()
        self.row_block = row_block
        self.fused = fused  # the FFN alignment as one Triton kernel where it runs (fused_here)
        assert local_heads % group == 0, f"align_group {group} straddles TP ranks ({local_heads} heads)"
        self.group = group
        groups, local = num_heads // group, local_heads // group
        # Full-size init then this rank's groups: the same model at every tensor-parallel size.
        self.mix = _split_param(torch.eye(group).expand(groups, group, group).clone(), local)
        # Weight decay would pull the mixing from the identity (the inherited scores) towards zero.
        self.mix.no_weight_decay = True
        self.hidden = hidden
        if not hidden:  # align_hidden = 0: linear head mixing only
            return
        self.w1 = _split_param(torch.randn(groups, hidden, group) / math.sqrt(group), local)
        self.b1 = _split_param(torch.zeros(groups, hidden), local)
        self.w2 = _split_param(torch.zeros(groups, group, hidden), local)
        self.b2 = _split_param(torch.zeros(groups, group), local)
        self.b1.no_weight_decay = self.b2.no_weight_decay = True  # biases, 2-D for their groups

    def nonlinear(self, s: torch.Tensor) -> torch.Tensor:
        """The FFN's part of the aligned scores: s [batch, groups, group, rows, keys] -> same shape.

        On CPU it runs over pieces of the scores whose hidden activations take about
        HIDDEN_PIECE_BYTES, so that its passes over them (matmul, bias, GELU, matmul) stay in a core's
        cache: 2-3x faster than passes over the whole block (a decode step of 8 sequences at 4k
        positions, a training block of 256 query rows). A GPU takes the block whole (pieces would
        multiply its kernel launches), and so does torch.compile (pieces would multiply the graph's
        nodes, tens of thousands along a LISA chain at 2k positions, and its compile time)."""
        w1, b1, w2, b2 = (p.to(s.dtype) for p in (self.w1, self.b1, self.w2, self.b2))
        flat = s.flatten(3)  # [batch, groups, group, rows * keys]
        piece = flat.shape[-1]
        if s.device.type == "cpu" and not torch.compiler.is_compiling():
            piece = max(1, HIDDEN_PIECE_BYTES // (flat.shape[0] * flat.shape[1] * self.hidden * s.element_size()))
        parts = [w2 @ F.gelu(w1 @ part + b1[..., None]) + b2[..., None] for part in flat.split(piece, dim=-1)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(s.shape)

    def weights(self) -> tuple:
        """(mix, w1, b1, w2, b2), the last four None for linear head mixing."""
        if not self.hidden:
            return self.mix, None, None, None, None
        return self.mix, self.w1, self.b1, self.w2, self.b2

    def fused_here(self, scores: torch.Tensor) -> bool:
        """Whether the FFN alignment of these scores runs as the fused kernel: with fused, on a GPU
        in 16/32-bit floats, or under Triton's interpreter (the tests)."""
        return bool(self.fused and self.hidden) and (
            (scores.is_cuda and scores.dtype != torch.float64) or triton_interpreted())

    def forward(self, scores: torch.Tensor, recompute_rows: bool = True) -> torch.Tensor:
        """scores [batch, local_heads, q, k] -> same shape, heads mixed within groups.

        Each group's heads are the rows of a matrix [group, q * k], so the mixing and the FFN are
        small matmuls over contiguous scores (no copy with the heads moved last). The FFN's hidden
        layer is align_hidden times the size of the scores, so it runs in blocks of row_block query
        rows and, when gradients are on, is recomputed in backward (only the scores are kept);
        recompute_rows=False for callers that recompute a block of rows themselves."""
        if self.fused_here(scores):  # keeps only the scores for backward: no blocks to recompute
            try:
                from models.attention.kernels.lisa_align_triton import fused_align
            except ImportError:  # no Triton on this machine
                self.fused = False
            else:
                return fused_align(scores, self.mix, self.w1, self.b1, self.w2, self.b2)
        b, h, sq, sk = scores.shape
        s = scores.reshape(b, h // self.group, self.group, sq, sk)
        out = (self.mix.to(s.dtype) @ s.flatten(3)).view(s.shape)
        if self.hidden and not recompute_rows:
            out = out + self.nonlinear(s)
        elif self.hidden:
            ffn = partial(checkpoint, self.nonlinear, use_reentrant=False) if torch.is_grad_enabled() else self.nonlinear
            blocks = [ffn(s[:, :, :, i:i + self.row_block]) for i in range(0, sq, self.row_block)]
            out = out + (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=3))
        return out.view(b, h, sq, sk)


class AlignedScores:
    """A LISA layer's scores align(shared) + q @ k^T, left lazy: built a block of query rows at a
    time by this layer and by a following LISA layer (rows: square scores only), or all at once."""

    square = True

    def __init__(self, shared, align: HeadAlign, q: torch.Tensor, k: torch.Tensor,
                 cuts: tuple[RowCut, RowCut] | None = None):
        self.shared, self.align, self.q, self.k = shared, align, q, k
        self.cuts = cuts  # RowCut of q and of k (from cut())

    def rows(self, start: int, end: int) -> torch.Tensor:
        aligned = self.align(self.shared.rows(start, end).to(self.q.dtype), recompute_rows=False)
        q_cut, k_cut = self.cuts or (None, None)
        keys = cut_prefix(self.k, k_cut, start, end)
        return aligned + cut_rows(self.q, q_cut, start, end) @ keys.transpose(-2, -1)

    def cut(self, size: int) -> AlignedScores:
        """The same scores, whose rows() of blocks of `size` query rows read pre-cut inputs."""
        return AlignedScores(self.shared.cut(size), self.align, self.q, self.k,
                             (RowCut.of(self.q, size), RowCut.of(self.k, size)))

    def materialize(self) -> torch.Tensor:
        return self.align(explicit_scores(self.shared).to(self.q.dtype)) + self.q @ self.k.transpose(-2, -1)


class KeptRows:
    """A LISA layer's scores as the causal row blocks it built (queries start..end-1 over keys
    0..end-1 each), kept for the next LISA layer (model.lisa.keep_chain_scores). Read by the same
    blocks, a block is returned as kept; other rows are cut from the blocks, keys past a block's
    end (after every query of it, so masked) filled with zeros."""

    square = True

    def __init__(self, blocks: list[tuple[int, torch.Tensor]]):
        self.blocks = blocks  # (start, rows [batch, heads, block rows, end])

    def rows(self, start: int, end: int) -> torch.Tensor:
        pieces = []
        for first, block in self.blocks:
            last = first + block.shape[-2]
            if (first, last) == (start, end):
                return block
            lo, hi = max(start, first), min(end, last)
            if lo < hi:
                piece = block[..., lo - first:hi - first, :end]
                pieces.append(F.pad(piece, (0, end - piece.shape[-1])))
        return torch.cat(pieces, dim=-2)

    def materialize(self) -> torch.Tensor:
        first, block = self.blocks[-1]
        return self.rows(0, first + block.shape[-2])

    def cut(self, size: int) -> KeptRows:
        return self


def kept_rows_per_token(seq: int, block_size: int) -> float:
    """Keys per query row that KeptRows holds: each block's rows over the keys up to its end."""
    return sum(end * (end - start) for start, end in row_blocks(seq, block_size)) / seq


class LISAAttention(nn.Module):
    publish = ProjectedAttention.publish
    capture = ProjectedAttention.capture

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.publish_scores = False
        self.local_heads = local_heads(cfg)
        self.head_dim = cfg.head_dim
        self.rank, group, hidden = lisa_sizes(cfg)
        # The weight function of the layer whose scores it realigns (relu or softmax).
        self.family = registry.attention_kind(registry.score_source(cfg.attention_kinds(), layer)).score_family
        self.relu = cfg.relu_attention
        self.kernel, self.block_size = cfg.lisa.kernel, cfg.lisa.block_size
        self.keep_chain_scores = cfg.lisa.keep_chain_scores
        d = cfg.hidden_size
        self.qk = column_linear(cfg, d, 2 * cfg.num_heads * self.rank)  # head-major [head, q|k, rank]
        with torch.no_grad():  # zero correction at init: the layer starts as pure (aligned) sharing
            self.qk.weight.view(self.local_heads, 2, self.rank, d)[:, 1].zero_()
        self.v = column_linear(cfg, d, cfg.kv_width)
        self.out = row_linear(cfg, d, d)
        self.align = HeadAlign(cfg.num_heads, self.local_heads, group, hidden, cfg.lisa.block_size,
                               fused=cfg.lisa.kernel == "auto")
        self.rotary = Rotary(self.rank, cfg.max_seq_len, cfg.rope_base)

    def shared_scores(self, ctx: dict) -> torch.Tensor | SharedScores:
        shared = ctx.get("shared_scores")
        if shared is None:
            raise RuntimeError(
                f"LISA layer {self.layer} found no attention scores from layer {self.layer - 1}; "
                "was that layer built with publish_scores (models.registry.build_attention does this)?"
            )
        return shared

    def low_rank(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated rank-r queries and keys [batch, heads, seq, rank] at positions offset onwards, the
        queries / sqrt(rank)."""
        b, s, _ = x.shape
        qk, _ = self.qk(x)
        q, k = qk.view(b, s, self.local_heads, 2, self.rank).permute(3, 0, 2, 1, 4).unbind(0)
        return self.rotary(q, offset) / math.sqrt(self.rank), self.rotary(k, offset)

    def factored(self, shared: torch.Tensor | SharedScores, ctx: dict) -> bool:
        """Whether this forward attends over score features (kernel auto / torch, linear alignment).
        Decoding after cached keys takes the explicit new score rows instead: a few rows cost less
        than concatenating every cached key's features at each step."""
        return (self.lazy(shared, ctx) and not self.align.hidden and isinstance(shared, SharedScores)
                and shared.mixable(self.align.group))

    def mixes_key_heads(self, shared: SharedScores) -> bool:
        """Whether an alignment group reads several key heads: the score features then hold each of
        them side by side, multiplying the QK work by their count, where the fused kernel mixes the
        group's products (one product per head; on a GPU it runs such a layer right after a full
        layer)."""
        return any(block.share % self.align.group for block in shared.blocks)

    def lazy(self, shared, ctx: dict) -> bool:
        """Whether this forward leaves the scores lazy: over features where factored(), else by query
        blocks (kernel auto / torch; not when capturing the weights or decoding after cached keys)."""
        return (self.kernel != "naive" and not isinstance(shared, torch.Tensor) and shared.square
                and not ctx.get("capture_attention"))

    def weights(self, scores: torch.Tensor, documents: torch.Tensor | None, seq_len: int | None = None
                ) -> torch.Tensor:
        """Attention weights of the last scores.shape[-2] of scores.shape[-1] positions."""
        if self.family == "relu":
            return relu_weights(scores, self.relu.normalizer, documents, seq_len)
        return causal_softmax(scores, documents)

    def mix(self, scores: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Attention weights from the explicit scores, applied to the values [batch, heads, seq, head_dim]."""
        weights = self.weights(scores, ctx.get("document_ids"), ctx.get("row_length"))
        self.capture(ctx, weights, normalised=self.family != "relu")
        return grouped_matmul(weights.to(v.dtype), v)

    def attend_rows(self, scores: AlignedScores, values: torch.Tensor, documents, seq: int, start: int,
                    end: int, keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows start..end-1 of the output from values [batch, kv_heads, end, head_dim] (and the
        scores of those rows with keep)."""
        s = scores.rows(start, end)
        o = grouped_matmul(self.weights(s, documents, seq).to(values.dtype), values)
        return o, (s if keep else None)

    def attend_by_rows(self, scores: AlignedScores, v: torch.Tensor, ctx: dict, keep: bool
                       ) -> tuple[torch.Tensor, KeptRows | None]:
        """mix() a block of query rows at a time, each recomputed in backward: only the inputs are
        kept, and with keep the blocks' scores too (returned as KeptRows)."""
        documents, seq = ctx.get("document_ids"), v.shape[-2]
        scores, v_cut = scores.cut(self.block_size), RowCut.of(v, self.block_size)
        parts, kept = [], []
        for i, (start, end) in enumerate(row_blocks(seq, self.block_size)):
            rows = partial(self.attend_rows, scores, v_cut.prefixes[i], documents, seq, start, end, keep)
            o, s = checkpoint(rows, use_reentrant=False) if torch.is_grad_enabled() else rows()
            parts.append(o)
            if keep:
                kept.append((start, s))
        return torch.cat(parts, dim=-2), (KeptRows(kept) if keep else None)

    def flash(self, shared, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict,
              mixed: SharedScores | None = None) -> torch.Tensor | None:
        """The output by the fused kernel (kernels/lisa_flash_triton.py), or None where it does not
        run: it needs kernel=auto, a GPU in bf16 / fp16 (or Triton's interpreter), alignment groups of
        at most LISA_FLASH_MAX_GROUP heads, widths up to LISA_FLASH_MAX_WIDTH, and scores from a layer's own
        projections, directly or through one LISA layer (a chain of two: the previous layer's
        alignment is rebuilt in the kernel; with linear alignment the kernel reads its mixed queries
        and keys as the source and adds its low-rank term in a first stage that mixes nothing).
        `mixed`: linear alignment whose groups each read one key head, the source's scores with their
        queries mixed by this layer (SharedScores.mixed); the kernel then takes each head as a group
        of one, one product per tile as in flash attention, whatever the group's size."""
        if self.kernel != "auto" or not (q.is_cuda or triton_interpreted()):
            return None
        stages, group = [(*self.align.weights(), q, k)], self.align.group
        if isinstance(shared, AlignedScores):
            stages.insert(0, (*shared.align.weights(), shared.q, shared.k))
            shared = shared.shared
        if not isinstance(shared, SharedScores):  # kept rows, or a longer chain
            return None
        if mixed is not None:
            shared, stages, group = mixed, [(q.new_ones(q.shape[1], 1, 1), None, None, None, None, q, k)], 1
        elif not self.align.hidden and len(stages) == 1 and len(shared.blocks) == 2:  # a linear LISA layer's
            source, low = shared.blocks  # its mixed source and its low-rank term
            if low.share != 1:
                return None
            same = torch.eye(group, dtype=q.dtype, device=q.device).expand(q.shape[1] // group, group, group)
            shared, stages = SharedScores([source]), [(same, None, None, None, None, low.q, low.k), *stages]
        if group > LISA_FLASH_MAX_GROUP:
            return None
        try:
            from models.attention.kernels.lisa_flash_triton import flash_lisa, supports
        except ImportError:  # no Triton on this machine
            return None
        source_q, source_k = shared.features()
        if not supports(source_q.shape[-1], q.shape[-1], v.shape[-1], group, q.dtype):
            return None
        normalizer = self.relu.normalizer if self.family == "relu" else "softmax"
        return flash_lisa(source_q, source_k, stages, v, normalizer, ctx.get("document_ids"))

    def attend_features(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """The same attention from score features q @ k^T (k with fewer heads when shared)."""
        documents = ctx.get("document_ids")
        if k.shape[1] != v.shape[1]:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        if self.family == "relu":
            return relu_attend(q, k, v, self.relu, documents, scale=1.0)
        # Fused SDPA kernels want one width for q, k and v (else the math path builds seq^2 scores).
        width = v.shape[-1]
        o = softmax_attention(q, k, F.pad(v, (0, q.shape[-1] - width)), documents, scale=1.0,
                              block_mask=partial(block_mask_for, ctx, documents, q.shape[-2]))
        return o[..., :width]

    def decode_fused(self, shared, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict
                     ) -> torch.Tensor | None:
        """The output of the fused kernel for one new token after cached keys
        (lisa_decode_triton.lisa_decode), or None where it does not run: it needs kernel=auto,
        inference, a GPU (or Triton's interpreter) and the new score row handed over, and does not
        capture the weights or mask documents."""
        decoding_one = isinstance(shared, torch.Tensor) and q.shape[-2] == 1 and ctx.get("kv_cache") is not None
        if not (decoding_one and self.kernel == "auto" and not torch.is_grad_enabled()
                and not ctx.get("capture_attention") and ctx.get("document_ids") is None):
            return None
        if not (q.is_cuda or triton_interpreted()):  # the kernel's module imports Triton
            return None
        try:
            from models.attention.kernels.lisa_decode_triton import lisa_decode
        except ImportError:  # no Triton on this machine
            return None
        keys = k.shape[-2]
        normaliser = None
        if self.family == "relu":
            normaliser = relu_normaliser(self.relu.normalizer, 1, keys, q.device, keys - 1)
        align = self.align
        ffn = (align.w1, align.b1, align.w2, align.b2) if align.hidden else None
        o, scores = lisa_decode(shared, q, k, v, align.mix, ffn, normaliser, store_scores=self.publish_scores)
        self.publish(ctx, scores)  # only where a LISA layer follows (then the kernel stored them)
        return o

    def forward(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        b, s, _ = x.shape
        shared = self.shared_scores(ctx)
        q, k = self.low_rank(x, ctx.get("position_offset", 0))
        v, _ = self.v(x)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        if ctx.get("kv_cache") is not None:  # decoding: rank-r keys and values of earlier positions too
            k, v = ctx["kv_cache"].extend(self.layer, k, v)
        o = self.decode_fused(shared, q, k, v, ctx)
        if o is None:
            o = self.attend(shared, q, k, v, ctx)
        out, _ = self.out(o.transpose(1, 2).flatten(2))
        return out

    def attend(self, shared, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """The attention output [batch, heads, seq, head_dim] by the PyTorch paths."""
        recompute = ctx.get("recompute_attention")  # selective activation checkpointing
        if self.factored(shared, ctx):
            mixed = None
            if len(shared.blocks) == 1 and not self.mixes_key_heads(shared):  # one key head per group
                mixed = shared.mixed(self.align.mix, self.align.group)  # for the kernel and the next layer
            # the fused kernel where the source is a full layer's own projections (one block), or a
            # LISA layer reading them (two)
            o = self.flash(shared, q, k, v, ctx, mixed) if len(shared.blocks) <= 2 else None
            if o is not None and not self.publish_scores:
                return o
            if mixed is None:
                mixed = shared.mixed(self.align.mix, self.align.group)
            scores = mixed.plus(q, k)
            if o is not None:  # a following LISA layer attends over the features
                self.publish(ctx, scores)
                return o
            attend, inputs = self.attend_features, (*scores.features(), v, ctx)
        elif self.lazy(shared, ctx):  # recomputes by blocks already, or in the fused kernel
            scores = AlignedScores(shared, self.align, q, k)
            o = self.flash(shared, q, k, v, ctx)
            if o is not None:  # a following LISA layer rebuilds these scores in its own kernel
                self.publish(ctx, scores)
                return o
            o, kept = self.attend_by_rows(scores, v, ctx, keep=self.keep_chain_scores and self.publish_scores)
            self.publish(ctx, scores if kept is None else kept)
            return o
        else:
            scores = AlignedScores(shared, self.align, q, k).materialize()
            attend, inputs = self.mix, (scores, v, ctx)
        self.publish(ctx, scores)
        return checkpoint(attend, *inputs, use_reentrant=False) if recompute else attend(*inputs)


def validate(cfg: ModelConfig, kinds: list[str], sizes: registry.ParallelSizes) -> None:
    """Where lisa layers may go and whether their sizes fit."""
    lisa = cfg.lisa
    zero_means = {"align_group": "0: all heads in one group", "align_hidden": "0: linear head mixing",
                  "keep_full_layers": "0: none", "rank": "0: head_dim / 8"}
    for key, zero in zero_means.items():
        if getattr(lisa, key) < 0:
            raise ConfigError(f"model.lisa.{key}={getattr(lisa, key)} must be >= 0 ({zero})")
    early = [i for i, k in enumerate(kinds[: lisa.keep_full_layers]) if k == "lisa"]
    if early:
        fix = (f"move them to layer {lisa.keep_full_layers} or later, or lower keep_full_layers"
               if lisa.keep_full_layers < len(kinds) else
               f"lower keep_full_layers below {len(kinds)}, the model's number of layers")
        raise ConfigError(
            f"model.attention puts lisa at layers {early}, but model.lisa.keep_full_layers="
            f"{lisa.keep_full_layers} keeps the first layers as full attention; {fix}"
        )
    if lisa.kernel not in KERNELS:
        raise ConfigError(f"model.lisa.kernel={lisa.kernel!r}: choose one of {KERNELS}")
    if reuses_relu_scores(cfg) and cfg.relu_attention.normalizer not in RELU_NORMALIZERS:
        raise ConfigError(f"model.relu_attention.normalizer={cfg.relu_attention.normalizer!r}: choose one of "
                          f"{RELU_NORMALIZERS} (a LISA layer after a relu-family layer applies it)")
    if lisa.block_size < 1:
        raise ConfigError(f"model.lisa.block_size={lisa.block_size} must be >= 1 (query rows per block)")
    rank = lisa.resolved_rank(cfg.head_dim)
    if rank % 2 or rank < 2:
        raise ConfigError(f"model.lisa.rank={lisa.rank} must be even and >= 2 (RoPE rotates pairs)")
    if rank > cfg.head_dim:  # a head's own Q.K^T has rank head_dim at most: more only adds parameters
        raise ConfigError(f"model.lisa.rank={lisa.rank} exceeds head_dim {cfg.head_dim}; give at most {cfg.head_dim} "
                          f"(0: head_dim / 8)")
    group = lisa.resolved_group(cfg.num_heads)
    if cfg.num_heads % group:
        raise ConfigError(
            f"model.lisa.align_group={lisa.align_group} must divide model.num_heads={cfg.num_heads}"
        )
    if cfg.num_heads // sizes.tensor % group:
        raise ConfigError(
            f"model.lisa.align_group={lisa.align_group} (groups of {group} heads) must divide the heads per "
            f"tensor-parallel rank ({cfg.num_heads} / parallel.tensor={sizes.tensor}): alignment groups "
            "cannot straddle ranks; " + (f"set model.lisa.align_group to a divisor of {cfg.num_heads // sizes.tensor} "
                                         "(0 means all heads)" if lisa.align_group == 0 else
                                         "lower model.lisa.align_group or parallel.tensor")
        )


def lisa_signature(cfg: ModelConfig) -> dict:
    """model.lisa's keys that fix the layers, as built (rank and align_group 0 spell their
    resolved sizes), and the ReLU normaliser where a LISA layer applies it."""
    skip = registry.training_only_keys()
    out = {f"lisa.{key}": value for key, value in vars(cfg.lisa).items() if f"lisa.{key}" not in skip}
    out["lisa.rank"], out["lisa.align_group"] = cfg.lisa.resolved_rank(cfg.head_dim), cfg.lisa.resolved_group(cfg.num_heads)
    if reuses_relu_scores(cfg):
        out["relu_attention.normalizer"] = cfg.relu_attention.normalizer
    return out


registry.register_attention(registry.AttentionKind(
    name="lisa", letter="l", module=LISAAttention, params=lisa_param_count, score_flops=lisa_score_flops,
    activations=lisa_activations, handed_on=lisa_handed_on, reads_previous_scores=True, validate=validate,
    hf_remote=True, sections=("lisa", "relu_attention"), signature=lisa_signature,
))
