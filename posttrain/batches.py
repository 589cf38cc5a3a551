"""Tokenized post-training examples -> micro-batches: padded or packed rows, a seeded order per
epoch, split by data-parallel rank, with a resume state that continues at the next micro-batch.

Batches are dicts of tensors:
    tokens     [rows, L + 1]  inputs and next-token labels (right padded)
    trained    [rows, L + 1]  True where the token is a training target (a response token or its EOS)
    documents  [rows, L]      packed rows only: the example each input position belongs to
Preference batches hold the chosen rows, then the rejected rows (rows = 2 x micro_batch), and for
SGA also
    prompt_tokens [micro, P]  the raw prompts (no scores), right padded
    prompt_last   [micro]     the index of each raw prompt's last token
    scores        [micro, m]  the chosen responses' scores (the value head's targets)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_MULTIPLE = 8  # rows are padded to a multiple of this many tokens: fewer distinct shapes


@dataclass
class Row:
    ids: np.ndarray  # int64
    trained: np.ndarray  # bool, same length
    documents: np.ndarray | None = None  # packed rows: example index per token


@dataclass
class PairExample:
    chosen: Row  # prompt (with scores for SGA) + chosen response
    rejected: Row
    raw_prompt: list[int]
    scores: np.ndarray  # float32 [objectives]; empty without scores


def response_row(prompt: list[int], response: list[int]) -> Row:
    return Row(np.array(prompt + response, dtype=np.int64),
               np.array([False] * len(prompt) + [True] * len(response), dtype=bool))


def pack(rows: list[Row], length: int) -> list[Row]:
    """Consecutive rows joined into rows of at most `length` tokens (a row that does not fit starts
    the next one); `documents` numbers the examples of each packed row."""
    packed, current = [], []

    def close():
        if current:
            # No token of its own document comes before an example's first: never a target (unpacked,
            # the label shift drops it; packed, it would be predicted from the example before).
            trained = [np.concatenate([[False], r.trained[1:]]) for r in current]
            packed.append(Row(np.concatenate([r.ids for r in current]), np.concatenate(trained),
                              np.concatenate([np.full(len(r.ids), i) for i, r in enumerate(current)])))

    used = 0
    for row in rows:
        if current and used + len(row.ids) > length:
            close()
            current, used = [], 0
        current.append(row)
        used += len(row.ids)
    close()
    return packed


def _padded_length(lengths, cap: int | None = None) -> int:
    longest = max(lengths)
    padded = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    return min(padded, cap) if cap else padded


def collate_rows(rows: list[Row], pad_id: int, cap: int | None = None) -> dict[str, torch.Tensor]:
    length = _padded_length([len(r.ids) for r in rows], cap)
    tokens = np.full((len(rows), length), pad_id, dtype=np.int64)
    trained = np.zeros((len(rows), length), dtype=bool)
    for i, r in enumerate(rows):
        tokens[i, :len(r.ids)], trained[i, :len(r.ids)] = r.ids, r.trained
    lengths = torch.tensor([len(r.ids) for r in rows])
    # the inputs (tokens[:, :-1]) that are not padding: routed MLPs keep padding out of their balance
    real = torch.arange(length - 1)[None, :] < lengths[:, None]
    batch = {"tokens": torch.from_numpy(tokens), "trained": torch.from_numpy(trained), "real": real}
    if rows[0].documents is not None:
        # Padding after the last example is a document of its own (it sees only padding).
        documents = np.full((len(rows), length), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            documents[i, :len(r.ids)] = r.documents
            documents[i, len(r.ids):] = r.documents[-1] + 1
        batch["documents"] = torch.from_numpy(documents[:, :-1])
    return batch


def chunked(rows: list[Row], size: int, pad_id: int, cap: int) -> list[dict[str, torch.Tensor]]:
    """`rows` in order as padded batches of up to `size` (for evaluation over a whole set), padded to at
    most `cap` tokens (model.max_seq_len + 1: padding must not take a batch past the model's positions)."""
    return [collate_rows(rows[i:i + size], pad_id, cap) for i in range(0, len(rows), size)]


def collate_pairs(pairs: list[PairExample], pad_id: int, cap: int | None = None) -> dict[str, torch.Tensor]:
    batch = collate_rows([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id, cap)
    if pairs[0].scores.size:
        # model inputs only (no label column): at most cap - 1 = model.max_seq_len positions
        length = _padded_length([len(p.raw_prompt) for p in pairs], cap - 1 if cap else None)
        prompts = np.full((len(pairs), length), pad_id, dtype=np.int64)
        for i, p in enumerate(pairs):
            prompts[i, :len(p.raw_prompt)] = p.raw_prompt
        batch.update(prompt_tokens=torch.from_numpy(prompts),
                     prompt_last=torch.tensor([len(p.raw_prompt) - 1 for p in pairs]),
                     scores=torch.from_numpy(np.stack([p.scores for p in pairs])))
    return batch


class ExampleBatches:
    """Endless micro-batches of `units` (rows or pairs): each epoch a permutation seeded by
    (seed, epoch); global micro-batch g of an epoch holds units order[start + g*micro : start +
    (g+1)*micro], and data-parallel rank r takes g = r, r + dp, ... (the epoch's last incomplete round
    is dropped, so every rank takes the same number). `start` is 0, except in the epoch a resume
    lands in: the units consumed before it, so any micro-batch and data-parallel size continues at
    the same unit. Tensor-parallel peers share a data-parallel rank and get the same batches."""

    def __init__(self, units: list, collate, micro_batch: int, dp_rank: int, dp_size: int, seed: int):
        self.units, self.collate = units, collate
        self.micro, self.dp_rank, self.dp_size, self.seed = micro_batch, dp_rank, dp_size, seed
        if len(units) // (micro_batch * dp_size) == 0:
            raise ValueError(f"{len(units)} examples are fewer than one micro-batch on every data-parallel rank "
                             f"({micro_batch} x {dp_size}); add examples or lower train.micro_batch")
        self.epoch, self.start, self.index = 0, 0, 0
        self._order = None

    def _rounds(self) -> int:
        """Micro-batches per rank in this epoch, from its start."""
        return (len(self.units) - self.start) // (self.micro * self.dp_size)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = (self.epoch, rng.permutation(len(self.units)))
        return self._order[1]

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.index >= self._rounds():
            self.epoch, self.start, self.index = self.epoch + 1, 0, 0
        g = self.index * self.dp_size + self.dp_rank
        first = self.start + g * self.micro
        picked = self._epoch_order()[first:first + self.micro]
        self.index += 1
        return self.collate([self.units[i] for i in picked])

    def state_dict(self) -> dict:
        """The epoch and the examples of it consumed by all ranks (in the order train.seed draws: the
        run's meta records it as data_seed, and a resume with another is refused)."""
        return {"epoch": self.epoch, "consumed": self.start + self.index * self.micro * self.dp_size,
                "units": len(self.units)}

    def load_state_dict(self, state: dict) -> None:
        if "consumed" not in state:  # another loader's position (a weights-only or pretraining checkpoint)
            self.epoch, self.start, self.index = 0, 0, 0
            return
        if state["units"] != len(self.units):
            raise ValueError(f"the checkpoint's data position is in {state['units']} examples, the data now has "
                             f"{len(self.units)}; resume with the run's post.data, or start a new run.dir")
        self.epoch, self.start, self.index = int(state["epoch"]), int(state["consumed"]), 0


def fixed_batches(units: list, collate, micro_batch: int, dp_rank: int, dp_size: int, count: int) -> list:
    """Validation: the first `count` x `micro_batch` x `dp_size` examples in file order (all of a
    smaller set), each once, rounded down to a multiple of `dp_size`; rank r takes the r-th of
    dp_size equal blocks of them, in micro-batches of up to `micro_batch`, so every rank runs as many
    (and rank 0's first, the sink probe, holds the first examples at any data-parallel size)."""
    per_rank = min(len(units), count * micro_batch * dp_size) // dp_size
    mine = units[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [collate(mine[i:i + micro_batch]) for i in range(0, len(mine), micro_batch)]
