"""Post-training files -> tokenized training units: SFT rows (padded or packed) or preference
pairs (with SGA's score-conditioned prompts), read, checked and tokenized once."""

from __future__ import annotations

import hashlib

import numpy as np

from data_prep.sources import BadInputReport
from models.generation import context_window
from posttrain import records
from posttrain.batches import PairExample, Row, pack, response_row
from posttrain.chat import ChatEncoder, ScoreFormat, with_scores
from posttrain.config import PostTrainConfig, example_length


def truncate(ids: np.ndarray, trained: np.ndarray, limit: int, keep_end: bool, bos: int | None):
    """An SFT example cut to `limit` tokens: its first ones, or its last (BOS kept first where one
    begins it)."""
    if not keep_end:
        return ids[:limit], trained[:limit]
    # generation's window over the positions: position 0 stands for BOS where the example begins with it
    index = context_window(list(range(len(ids))), limit, 0 if bos is not None and ids[0] == bos else None)
    return ids[index], trained[index]


class Examples:
    """The files of post.data or post.val_data, read, checked and tokenized once."""

    def __init__(self, cfg: PostTrainConfig, files: list[str], encoder: ChatEncoder, objectives: list[str] | None,
                 objectives_of: str = "the data"):
        """`objectives`: SGA's, in order (None: the first record's); `objectives_of`: whose they are,
        for the message a record with others gets."""
        self.report = BadInputReport()
        self.too_long = 0  # dropped
        self.truncated = 0  # cut to fit (post.max_prompt_len, post.sft_truncation)
        self.units: list = []  # examples, or with post.packing the rows they are packed into
        self.examples = 0  # usable examples (packed or not)
        self.objectives = objectives
        limit = example_length(cfg)
        post = cfg.post
        if post.method == "sft":
            rows = []
            for messages, _ in records.read(files, records.sft_messages, self.report):
                ids, trained = encoder.conversation(messages)
                if len(ids) > limit:
                    if post.sft_truncation == "drop":
                        self.too_long += 1
                        continue
                    ids, trained = truncate(ids, trained, limit, post.sft_truncation == "keep_end", encoder.bos)
                    if not trained[1:].any():  # the first token is never a label
                        self.too_long += 1
                        continue
                    self.truncated += 1
                rows.append(Row(ids, trained))
            self.examples = len(rows)
            if post.packing:  # the packing order is seeded, so the rows are the same at every start
                order = np.random.default_rng(cfg.train.seed).permutation(len(rows))
                rows = pack([rows[i] for i in order], limit)
            self.units = rows
            return
        scores_fmt = ScoreFormat.from_config(post)
        parse = records.scored_preference if post.method == "sga" else records.preference
        for pair, where in records.read(files, parse, self.report):
            if post.method == "sga":
                if self.objectives is None:  # the first record's objectives, in its order
                    self.objectives = list(pair.scores)
                if sorted(pair.scores) != sorted(self.objectives):
                    self.report.add(where, f"scores {sorted(pair.scores)} are not the objectives of "
                                           f"{objectives_of} {sorted(self.objectives)}")
                    continue
                scores = {name: round(pair.scores[name], post.score_decimals) for name in self.objectives}
                prompt = encoder.prompt(with_scores(pair.prompt, scores, scores_fmt))
                raw_prompt = encoder.prompt(pair.prompt)
                target = np.array([scores[n] for n in self.objectives], dtype=np.float32)
            else:
                prompt = raw_prompt = encoder.prompt(pair.prompt)
                target = np.zeros(0, dtype=np.float32)
            responses = encoder.response(pair.chosen), encoder.response(pair.rejected)
            if len(prompt) + max(map(len, responses)) > limit and post.max_prompt_len:
                # In TRL's order: the prompt's last tokens (BOS kept first), then the responses' first.
                # SGA's scores (the tokens the conditioned prompt has beyond the raw one's common
                # start) stay whole, with some of the conversation, or the pair is dropped.
                common = next((i for i, (a, b) in enumerate(zip(prompt, raw_prompt)) if a != b),
                              min(len(prompt), len(raw_prompt)))
                window = post.max_prompt_len - (encoder.bos is not None and prompt[:1] == [encoder.bos])
                if window - (len(prompt) - common) < 2:  # not 2 tokens of the conversation beside the scores
                    self.too_long += 1
                    continue
                scores_len = len(prompt) - len(raw_prompt)
                prompt = context_window(prompt, post.max_prompt_len, encoder.bos)
                raw_prompt = context_window(raw_prompt, post.max_prompt_len - scores_len, encoder.bos)
                responses = tuple(ids[:limit - len(prompt)] for ids in responses)
                self.truncated += 1
            chosen, rejected = (response_row(prompt, ids) for ids in responses)
            if max(len(chosen.ids), len(rejected.ids)) > limit:
                self.too_long += 1
                continue
            self.units.append(PairExample(chosen, rejected, raw_prompt, target))
        self.examples = len(self.units)

    def score_levels(self, most: int = 11) -> dict[str, list[float]]:
        """SGA: each objective's distinct target values, where they lie on a scale of at most `most`
        steps of 1/n (HelpSteer2's and UltraFeedback's ratings / 4); predictions snap to them at
        inference. A continuous objective (HH-RLHF's) is no scale, however few values a small set has."""
        levels = {}
        for i, name in enumerate(self.objectives or []):
            values = sorted({round(float(unit.scores[i]), 6) for unit in self.units})  # float32 -> as written
            on_grid = lambda n: all(abs(v * n - round(v * n)) < 1e-4 for v in values)  # noqa: E731
            if len(values) <= most and any(on_grid(n) for n in range(1, most)):
                levels[name] = values
        return levels

    def fingerprint(self) -> str:
        """sha256 of the units' tokens, masks and targets in order: the same data, tokenized the same way."""
        digest = hashlib.sha256()
        for unit in self.units:
            pair = isinstance(unit, PairExample)
            for row in (unit.chosen, unit.rejected) if pair else (unit,):
                digest.update(row.ids.tobytes())
                digest.update(row.trained.tobytes())
            if pair:
                digest.update(np.asarray(unit.raw_prompt, dtype=np.int64).tobytes())
                digest.update(unit.scores.tobytes())
        return digest.hexdigest()
