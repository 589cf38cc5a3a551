"""Attention scores handed from one layer to the next (LISA) as query/key features, so that
neither layer builds the [batch, heads, seq, seq] scores unless it must:

    S[b, h] = sum over blocks of  q_blk[b, h] @ k_blk[b, h // share_blk]^T

A layer with its own projections hands over one block (q / sqrt(head_dim), k; share = query heads
per K/V head) and keeps its fused attention kernel. LISA's linear head alignment
S_hat[h] = sum_g M[h, g] S[g] (within groups of g heads) maps blocks to blocks exactly: where one
key serves the whole group, only the queries mix; where the group reads c = g / share distinct
keys, the block becomes their c keys side by side (c times wider), shared by the group, with
query h holding M[h, g] q[g] in key g's slot. The low-rank correction adds a per-head block, and
the layer attends once over the concatenated features with the memory-efficient kernels.
Widths add up along a chain of LISA layers; `materialize` gives the explicit scores (the
reference, and what the non-linear alignment needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def groups_line_up(share: int, group: int) -> bool:
    """Whether alignment groups of `group` heads line up with keys shared by `share` query heads:
    one key serves a whole group, or a group holds whole key groups."""
    return share % group == 0 or group % share == 0


def _per_head(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [batch, heads, s, w] @ b [batch, heads // share, w, t] -> [batch, heads, s, t], where each
    head of b (a grouped-query key or value head) serves `share` consecutive heads of a: their rows
    are stacked so that b is read once, not copied per head."""
    batch, heads, s, width = a.shape
    kv = b.shape[1]
    out = a.reshape(batch, kv, heads // kv * s, width) @ b
    return out.reshape(batch, heads, s, b.shape[-1])


def _product(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [batch, heads, s, w] @ k [batch, heads // share, t, w]^T -> [batch, heads, s, t]."""
    return grouped_matmul(q, k.transpose(-2, -1))


def row_blocks(seq: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the blocks of `size` query rows over seq positions, the last one shorter."""
    return [(start, min(start + size, seq)) for start in range(0, seq, size)]


class _Prefixes(torch.autograd.Function):
    """x[..., :end, :] for several ends at once, as views. Backward sums their gradients into one
    tensor of x's size, where slicing each would give every slice a gradient of x's size (a zero
    fill, a copy and a sum over x per slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: tuple[int, ...]):
        ctx.shape, ctx.ends = x.shape, ends
        return tuple(x[..., :end, :] for end in ends)

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for grad, end in zip(grads, ctx.ends):
            if grad is not None:
                total = grad.new_zeros(ctx.shape) if total is None else total
                total[..., :end, :] += grad
        return total, None


@dataclass(frozen=True)
class RowCut:
    """x [..., seq, width] cut for causal blocks of `size` query rows: rows start..end-1 and rows
    0..end-1 of every block, cut once for all blocks (see _Prefixes)."""
    size: int
    rows: tuple[torch.Tensor, ...]
    prefixes: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, x: torch.Tensor, size: int) -> RowCut:
        ends = tuple(end for _, end in row_blocks(x.shape[-2], size))
        return cls(size, x.split(size, dim=-2), _Prefixes.apply(x, ends))

    def block(self, start: int, end: int) -> int | None:
        """The index of the block start..end-1, or None where it is not one."""
        i, rem = divmod(start, self.size)
        return i if not rem and i < len(self.rows) and end == start + self.rows[i].shape[-2] else None


def cut_rows(x: torch.Tensor, cut: RowCut | None, start: int, end: int) -> torch.Tensor:
    """x[..., start:end, :], from the cut where it is one of its blocks."""
    i = cut.block(start, end) if cut is not None else None
    return x[..., start:end, :] if i is None else cut.rows[i]


def cut_prefix(x: torch.Tensor, cut: RowCut | None, start: int, end: int) -> torch.Tensor:
    """x[..., :end, :] for the block start..end-1, from the cut where it is one of its blocks."""
    i = cut.block(start, end) if cut is not None else None
    return x[..., :end, :] if i is None else cut.prefixes[i]


@dataclass(frozen=True)
class ScoreBlock:
    q: torch.Tensor  # [batch, heads, q_len, width]
    k: torch.Tensor  # [batch, heads // share, k_len, width]
    share: int  # query heads per key head


class SharedScores:
    def __init__(self, blocks: list[ScoreBlock], cuts: tuple[tuple[RowCut, RowCut], ...] | None = None):
        self.blocks = tuple(blocks)
        self.cuts = cuts  # per block, its queries' and keys' RowCut (from cut())

    @classmethod
    def of_projection(cls, q: torch.Tensor, k: torch.Tensor) -> SharedScores:
        """q . k / sqrt(head_dim) of rotated q [batch, heads, seq, d] and k [batch, kv_heads, seq, d]."""
        return cls([ScoreBlock(q / math.sqrt(q.shape[-1]), k, q.shape[1] // k.shape[1])])

    @property
    def heads(self) -> int:
        return self.blocks[0].q.shape[1]

    @property
    def square(self) -> bool:
        """Whether queries and keys cover the same positions (not decoding after cached keys)."""
        return self.blocks[0].q.shape[-2] == self.blocks[0].k.shape[-2]

    @property
    def width(self) -> int:
        """Feature width of the concatenated queries and keys."""
        return sum(b.q.shape[-1] for b in self.blocks)

    def materialize(self) -> torch.Tensor:
        """The explicit scores [batch, heads, seq, seq]."""
        return sum(_product(b.q, b.k) for b in self.blocks)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Explicit scores of queries start..end-1 over keys 0..end-1 (causal rows of square scores)."""
        cuts = self.cuts or [(None, None)] * len(self.blocks)
        return sum(_product(cut_rows(b.q, q_cut, start, end), cut_prefix(b.k, k_cut, start, end))
                   for b, (q_cut, k_cut) in zip(self.blocks, cuts))

    def cut(self, size: int) -> SharedScores:
        """The same scores, whose rows() of blocks of `size` query rows read pre-cut inputs."""
        cuts = tuple((RowCut.of(b.q, size), RowCut.of(b.k, size)) for b in self.blocks)
        return SharedScores(self.blocks, cuts)

    def mixable(self, group: int) -> bool:
        """Whether head groups of this size line up with every block's key sharing."""
        return all(groups_line_up(b.share, group) for b in self.blocks)

    def mixed(self, mix: torch.Tensor, group: int) -> SharedScores:
        """Scores sum_g mix[n, h, g] S[g] over the heads of each group n; mix [groups, group, group]."""
        mix = mix.to(self.blocks[0].q.dtype)
        out = []
        for b in self.blocks:
            batch, heads, seq, width = b.q.shape
            n = heads // group
            if b.share % group == 0:  # one key for the whole group: mix the queries
                # a matmul over the group's rows keeps the queries for backward as they are (an
                # einsum keeps a permuted copy)
                q = mix @ b.q.reshape(batch, n, group, seq * width)
                out.append(ScoreBlock(q.view(b.q.shape), b.k, b.share))
                continue
            c = group // b.share  # distinct keys per group, each read by `share` of its heads
            q = torch.einsum("bncrsw,nhcr->bnhscw", b.q.reshape(batch, n, c, b.share, seq, width),
                             mix.reshape(n, group, c, b.share))
            keys = b.k.shape[2]  # more than the queries when decoding after cached keys
            k = b.k.reshape(batch, n, c, keys, width).transpose(2, 3).reshape(batch, n, keys, c * width)
            out.append(ScoreBlock(q.reshape(batch, heads, seq, c * width), k, group))
        return SharedScores(out)

    def plus(self, q: torch.Tensor, k: torch.Tensor) -> SharedScores:
        """These scores plus q @ k^T per head (q, k [batch, heads, seq, width])."""
        return SharedScores([*self.blocks, ScoreBlock(q, k, 1)])

    def features(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [batch, heads, seq, width], keys [batch, heads / share, seq, width]) whose
        products are the scores; keys keep a common share, else one per head. One block's are its
        own tensors (not copies: a kernel that keeps them for backward shares them with the layers
        that keep them too)."""
        if len(self.blocks) == 1:
            return self.blocks[0].q, self.blocks[0].k
        shares = {b.share for b in self.blocks}
        keys = [b.k if len(shares) == 1 else _per_head(b.k, self.heads) for b in self.blocks]
        return torch.cat([b.q for b in self.blocks], -1), torch.cat(keys, -1)


def explicit_scores(shared) -> torch.Tensor:
    """Scores as a tensor, from a tensor or from lazy scores (SharedScores, or a LISA layer's own)."""
    return shared if isinstance(shared, torch.Tensor) else shared.materialize()
