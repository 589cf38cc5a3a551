"""data.synthetic: uniformly random tokens in place of shards, to try a config (its memory, its
speed, its launch across nodes) before any data exists. Nothing in them can be learnt: the loss
stays near ln(model.vocab_size).

Sample i is drawn from a generator seeded by (data.shuffle_seed, i) alone, so the data-parallel
ranks read disjoint samples (rank r takes the r-th micro-batch of every step's), tensor-parallel
peers the same ones, and a resume, at any data-parallel size, continues where the run stopped.
"""

from __future__ import annotations

import torch

VAL_OFFSET = 1 << 31  # validation samples: indices no training run reaches (2e9 samples)


def sample(seed: int, index: int, vocab_size: int, length: int) -> torch.Tensor:
    """Synthetic sample `index`: [length] token ids. torch's CPU generator keeps 32 bits of a seed:
    index times an odd number is one-to-one on them, so samples below 2^32 never share one."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + index * 0x85EBCA6B) & 0xFFFFFFFF)
    return torch.randint(0, vocab_size, (length,), generator=gen)


class SyntheticLoader:
    """Endless micro-batches [micro_batch, seq_len + 1] of this data-parallel rank, with the state a
    checkpoint keeps (samples consumed by all ranks, as streaming's sample_in_epoch)."""

    def __init__(self, seed: int, vocab_size: int, length: int, micro_batch: int, rank: int, ranks: int):
        self.seed, self.vocab_size, self.length = seed, vocab_size, length
        self.micro_batch, self.rank, self.ranks = micro_batch, rank, ranks
        self.consumed = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        first = self.consumed + self.rank * self.micro_batch
        self.consumed += self.micro_batch * self.ranks
        return torch.stack([sample(self.seed, first + i, self.vocab_size, self.length)
                            for i in range(self.micro_batch)])

    def state_dict(self) -> dict:
        return {"epoch": 0, "sample_in_epoch": self.consumed, "shuffle_seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["sample_in_epoch"]


def val_batches(seed: int, vocab_size: int, length: int, micro_batch: int, rank: int, count: int) -> list[torch.Tensor]:
    """`count` fixed validation micro-batches of a data-parallel rank (a block of them each, as
    pretrain.data.load_val_sets takes shards' samples)."""
    first = VAL_OFFSET + rank * count * micro_batch
    return [torch.stack([sample(seed, first + b * micro_batch + i, vocab_size, length) for i in range(micro_batch)])
            for b in range(count)]
