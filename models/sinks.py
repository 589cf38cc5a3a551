"""Attention-sink metrics (Gu et al., "When Attention Sink Emerges in LMs"):

    alpha_1^{l,h}(x) = mean over queries t of A^{l,h}_{t,1}     (weight on the first token of sequence x)
    Sink_1^eps       = mean over sequences x, layers l, heads h of 1(alpha_1^{l,h}(x) > eps),  eps = 0.3

(thresholded per sequence, then averaged, as Gu et al.'s code does: a head that sinks on some
sequences counts for their share). The alpha_1 reported per head is its mean over all their queries.

A is the weight each query puts on each value. Where the model attends within documents
(document_ids), "the first token" is the first token of the query's own document. For softmax it is a probability; for
softmax_sink rows sum to 1 - (weight on the sink logit); for ReLU attention it is the ABSOLUTE
weight ReLU(s)/n_i. For kernels whose rows need not sum to one the share of the row on the first
token would call a head that outputs ~0 a sink, so alpha_1 is the absolute weight and the mean
row total sum_j A_{t,j} is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_EPS = 0.3
DEFAULT_SEQ = 64  # Gu et al. measure at T = 64


@dataclass
class SinkStats:
    alpha1: torch.Tensor  # [layers, heads] mean absolute weight on the first token
    row_total: torch.Tensor  # [layers, heads] mean over queries of sum_j A_tj
    share1: torch.Tensor  # [layers, heads] mean over queries of A_t1 / sum_j A_tj (proxy, for contrast)
    layers: list[int]
    # alpha_1 of a head attending uniformly over the same queries: mean 1/(keys seen). Within short
    # documents it nears eps (0.34 at 8 tokens), so Sink_1^eps would count sink-free heads.
    uniform1: float = 0.0
    # [layers, sequences, heads] alpha_1 of each sequence (None: the per-head means stand for them),
    # and [sequences] bool: those with a query to average over (not all padding)
    alpha1_sequences: torch.Tensor | None = None
    sequences_kept: torch.Tensor | None = None

    def over_eps(self, eps: float = DEFAULT_EPS) -> torch.Tensor:
        """[layers, heads]: the share of sequences on which each head's alpha_1 exceeds eps."""
        if self.alpha1_sequences is None:
            return (self.alpha1 > eps).float()
        kept = self.sequences_kept.to(self.alpha1_sequences.device).float()[None, :, None]
        return ((self.alpha1_sequences > eps).float() * kept).sum(1) / kept.sum().clamp_min(1.0)

    def sink_rate(self, eps: float = DEFAULT_EPS) -> float:
        return float(self.over_eps(eps).mean())

    def layer_sink_rate(self, eps: float = DEFAULT_EPS) -> torch.Tensor:
        return self.over_eps(eps).mean(-1)


def _first_weights(weights: torch.Tensor, starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights as [batch, heads, q, k] in fp32, each query's weight on its first token [batch, heads, q])."""
    w = weights.float()
    if w.dim() == 3:
        w = w.unsqueeze(0)
    if starts is None:
        return w, w[..., 0]
    index = starts[:, None, -w.shape[-2]:, None].expand(*w.shape[:-1], 1)
    return w, w.gather(-1, index.to(w.device)).squeeze(-1)


def sequence_alpha1(weights: torch.Tensor, starts: torch.Tensor | None = None, queries: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_1 of each sequence [batch, heads], whether it has a query to average over [batch]), as
    head_stats takes its arguments."""
    w, first = _first_weights(weights, starts)
    if queries is None:
        return first.mean(-1), torch.ones(first.shape[0], dtype=torch.bool)
    keep = queries[:, None, -w.shape[-2]:].to(w.device, w.dtype)  # [batch, 1, q]
    count = keep.sum(-1)  # [batch, 1]
    return (first * keep).sum(-1) / count.clamp_min(1.0), count[:, 0].cpu() > 0


def head_stats(weights: torch.Tensor, starts: torch.Tensor | None = None, queries: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha1, row_total, share1), each [heads], from weights [batch, heads, q, k] (or [heads, q, k]);
    starts [batch, q]: the key each query counts as its first (its document's start), else key 0;
    queries [batch, q] bool: the queries to average over (not padding), else all."""
    w, first = _first_weights(weights, starts)
    total = w.sum(-1)
    share = first / total.clamp_min(1e-12)
    if queries is None:
        return first.mean((0, 2)), total.mean((0, 2)), share.mean((0, 2))
    keep = queries[:, None, -w.shape[-2]:].to(w.device, w.dtype)  # [batch, 1, q]
    count = keep.sum().clamp_min(1.0)

    def mean(t: torch.Tensor) -> torch.Tensor:
        return (t * keep).sum((0, 2)) / count

    return mean(first), mean(total), mean(share)


def uniform_alpha1(batch: int, seq: int, starts: torch.Tensor | None = None,
                   queries: torch.Tensor | None = None) -> float:
    """alpha_1 of a causal head that spreads each query's weight evenly over the keys it sees."""
    position = torch.arange(seq).expand(batch, seq)
    seen = position - (starts.cpu() if starts is not None else 0) + 1
    floor = 1.0 / seen.float()
    if queries is None:
        return float(floor.mean())
    keep = queries.cpu().float()
    return float((floor * keep).sum() / keep.sum().clamp_min(1.0))


def sink_stats(maps: dict[int, torch.Tensor], starts: torch.Tensor | None = None,
               queries: torch.Tensor | None = None) -> SinkStats:
    """Stats over captured maps {layer: [batch, heads, q, k]} (heads as held by this rank) over the
    `queries` [batch, q] that are not padding (default all)."""
    layers = sorted(maps)
    per = [head_stats(maps[layer], starts, queries) for layer in layers]
    sequences = [sequence_alpha1(maps[layer], starts, queries) for layer in layers]
    first = maps[layers[0]]
    batch, seq = (1 if first.dim() == 3 else first.shape[0]), first.shape[-2]
    return SinkStats(*(torch.stack([p[i] for p in per]) for i in range(3)), layers=layers,
                     uniform1=uniform_alpha1(batch, seq, starts, queries),
                     alpha1_sequences=torch.stack([a for a, _ in sequences]), sequences_kept=sequences[0][1])


@torch.no_grad()
def capture_attention(model, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                      row_length: int | None = None) -> dict[int, torch.Tensor]:
    """Run model.logits on tokens [batch, seq] with capture on (within documents with
    document_ids); returns {layer: weights} of the layers whose kind exposes its weights (all
    built-in kinds do). `row_length`: the sample length ReLU's seqlen normaliser divides by, as in
    training (model.max_seq_len; default seq: a shorter probe would weigh every row up). Under
    tensor parallelism every rank of the group must call it (it runs the forward)."""
    ctx = {"capture_attention": True}
    if row_length:
        ctx["row_length"] = row_length
    if document_ids is not None:
        ctx["document_ids"] = document_ids
    model.logits(tokens, ctx)
    return ctx.get("attention_maps", {})


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] -> the position where each position's document begins (ids never decrease)."""
    return torch.searchsorted(document_ids.contiguous(), document_ids.contiguous())


def measure(model, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
            queries: torch.Tensor | None = None, row_length: int | None = None) -> SinkStats | None:
    """Sink statistics of the layers that expose their weights; None when none does. With
    document_ids (a model trained within documents) it attends as trained, and alpha_1 is each
    query's weight on its own document's first token; queries [batch, seq] bool leaves padding out."""
    was_training = model.training
    model.eval()
    try:
        maps = capture_attention(model, tokens, document_ids, row_length)
    finally:
        model.train(was_training)
    starts = document_starts(document_ids) if document_ids is not None else None
    return sink_stats(maps, starts, queries) if maps else None


def gathered(stats: SinkStats) -> SinkStats:
    """Every head's statistics on every rank, in global head order (rank r holds heads r*local ..)."""
    from models.layers import gather_tensor_parallel

    sequences = stats.alpha1_sequences
    return SinkStats(gather_tensor_parallel(stats.alpha1), gather_tensor_parallel(stats.row_total),
                     gather_tensor_parallel(stats.share1), stats.layers, stats.uniform1,
                     None if sequences is None else gather_tensor_parallel(sequences), stats.sequences_kept)


def scalars(stats: SinkStats, eps: float = DEFAULT_EPS, per_head: bool = True) -> dict[str, float]:
    """Flat TensorBoard scalars: overall Sink_1^eps, per layer rate / mean alpha_1 / row total,
    and per head alpha_1."""
    out = {"sink_rate": stats.sink_rate(eps), "alpha1_mean": float(stats.alpha1.mean()),
           "alpha1_uniform": stats.uniform1}
    rates = stats.layer_sink_rate(eps)
    for i, layer in enumerate(stats.layers):
        key = f"layer{layer:02d}"
        out[f"{key}/sink_rate"] = float(rates[i])
        out[f"{key}/alpha1_mean"] = float(stats.alpha1[i].mean())
        out[f"{key}/row_total"] = float(stats.row_total[i].mean())
        if per_head:
            for h in range(stats.alpha1.shape[1]):
                out[f"{key}/head{h:02d}/alpha1"] = float(stats.alpha1[i, h])
    return out
