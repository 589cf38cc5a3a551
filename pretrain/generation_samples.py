"""Greedy continuations of eval.sample_prompts every train.eval_interval steps and at the last,
printed and logged (TensorBoard text samples/<i>, RUN_DIR/metrics.jsonl), to see what the model
writes as it trains (as llm-foundry's Generate callback). Every rank decodes the same prompts in
step, each forward together (ZeRO-3 gathers, expert-parallel exchanges): tensor-parallel ranks
gather the vocabulary-split logits, and rank 0's are broadcast, so that no rank can pick another
token (GPU kernels need not give every rank the same last bits) and leave the others waiting.
Under ZeRO-3 each new token is a forward that gathers the parameters: keep prompts few and short."""

from __future__ import annotations

import torch.distributed as dist

from data_prep.tokenizer import continuation_text, load_tokenizer
from models.generation import generate
from models.layers import gather_tensor_parallel
from pretrain.config import Config, ConfigError
from pretrain.data import run_bos
from pretrain.trainer import Callback


class FullVocabulary:
    """The model as generate() reads it: the logits over the whole vocabulary on every rank."""

    def __init__(self, model):
        self.model, self.cfg = model, model.cfg

    def parameters(self):
        return self.model.parameters()

    def hidden_states(self, tokens, ctx=None):
        return self.model.hidden_states(tokens, ctx)

    def output_logits(self, hidden):
        logits = gather_tensor_parallel(self.model.output_logits(hidden)).contiguous()  # the whole vocabulary
        if dist.get_world_size() > 1:
            dist.broadcast(logits, src=0)
        return logits


class GenerationSamples(Callback):
    def __init__(self, cfg: Config):
        self.prompts, self.new_tokens = cfg.eval.sample_prompts, cfg.eval.sample_tokens
        self.sp, _ = load_tokenizer(cfg.data.tokenizer)
        empty = [i for i, prompt in enumerate(self.prompts) if not self.sp.encode(prompt)]
        if empty:
            raise ConfigError(f"eval.sample_prompts {empty} encode to no token with data.tokenizer: give some text")

    def on_step_end(self, trainer, result) -> None:  # with validation or without
        step = result.step
        if not trainer.periodic_due(step, trainer.cfg.train.eval_interval, "generation samples"):
            return
        bos = run_bos(trainer.cfg, trainer.meta)  # as the run's samples begin
        model = trainer.model
        was_training = model.training
        model.eval()  # routed layers drop no token over capacity
        try:
            texts = {}
            for i, prompt in enumerate(self.prompts):
                ids = ([] if bos is None else [bos]) + self.sp.encode(prompt)
                new = generate(FullVocabulary(model), ids, self.new_tokens, greedy=True, eos_id=self.sp.eos_id(),
                               bos=bos)
                texts[str(i)] = continuation_text(self.sp, ids, new)
        finally:
            model.train(was_training)
        trainer.logger.text(step, texts, prefix="samples/")
        for i, prompt in enumerate(self.prompts):
            trainer.logger.print(f"step {step} | sample {i}: {prompt!r} -> {texts[str(i)]!r}")
