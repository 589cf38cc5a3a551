"""Attention-sink metrics (alpha_1, Sink_1^eps; models.sinks) logged at every evaluation."""

from __future__ import annotations

from models.sinks import DEFAULT_EPS, DEFAULT_SEQ, gathered, measure, scalars
from pretrain.trainer import Callback


class SinkMetricsCallback(Callback):
    """After every evaluation measure alpha_1 / Sink_1^eps on the first `seq` tokens of the fixed
    validation batch (trainer.probe_batch: attending as training did, padding left out) and log them under sinks/. Every rank runs the forward
    (tensor-parallel collectives); heads are gathered across the tensor-parallel group and only
    rank 0 writes."""

    def __init__(self, eps: float = DEFAULT_EPS, seq: int = DEFAULT_SEQ, per_head: bool = True):
        self.eps, self.seq, self.per_head = eps, seq, per_head

    def on_evaluate(self, trainer, step: int, val: dict[str, float]) -> None:
        seq = min(self.seq, trainer.cfg.model.max_seq_len)
        tokens, documents, queries = trainer.probe_batch(seq)
        # the same on every rank: all or none have maps; rows weighed as at the training length
        stats = measure(trainer.model, tokens, documents, queries, trainer.cfg.model.max_seq_len)
        if stats is not None:
            trainer.logger.scalars(step, scalars(gathered(stats), self.eps, self.per_head), prefix="sinks/")
