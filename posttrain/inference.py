"""SGA's two-stage inference on a training checkpoint of post.method=sga (any layout, consolidated
in this process; tools.consolidate's weight files leave the value head out): predict the objectives' scores from the
raw prompt with the value head, write them into the prompt as text, generate.

    sga = SGAModel.load("runs/sga")
    scores = sga.snap(sga.predict([{"role": "user", "content": "..."}]))  # {objective: score}
    ids = sga.generate(messages, scores, max_new_tokens=64)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models.generation import context_window, generate
from posttrain.chat import ChatEncoder, ChatFormat, ScoreFormat, with_scores
from posttrain.value_head import ValueHead, last_token_states
from pretrain.checkpoint_format import CheckpointError


@dataclass
class SGAModel:
    model: torch.nn.Module  # GPT at TP=1, eval mode
    value_head: ValueHead
    encoder: ChatEncoder
    scores_format: ScoreFormat
    objectives: list[str]
    levels: dict[str, list[float]]  # the objectives whose training targets were a scale, its values

    @classmethod
    def load(cls, checkpoint: str | Path, sp) -> SGAModel:
        """`sp`: the run's SentencePiece processor."""
        from pretrain.consolidate import load_model

        model, _, meta = load_model(checkpoint)
        info = meta.get("posttrain", {})
        if "value_head" not in meta.get("head_states", {}) or "value_head" not in info:
            raise CheckpointError(f"{meta['checkpoint']} has no value head: it was not trained with post.method=sga")
        spec = info["value_head"]
        head = ValueHead.from_spec(spec)
        head.load_state_dict(meta["head_states"]["value_head"])
        return cls(model, head.eval(), ChatEncoder(sp, ChatFormat.recorded(info["chat"])), ScoreFormat(**info["scores"]),
                   list(spec["objectives"]), info.get("score_levels", {}))

    @torch.no_grad()
    def predict(self, messages: list[dict]) -> dict[str, float]:
        # The prompt's last max_seq_len tokens, as generation keeps them (the value head reads the last one).
        prompt = self.encoder.prompt(messages)
        ids = torch.tensor([context_window(prompt, self.model.cfg.max_seq_len, self.encoder.bos)])
        hidden = last_token_states(self.model.hidden_states(ids), torch.tensor([ids.shape[1] - 1]))
        return dict(zip(self.objectives, self.value_head(hidden)[0].tolist()))

    def snap(self, scores: dict[str, float]) -> dict[str, float]:
        """Each score of an objective trained on a scale (HelpSteer2's 0, .25, ..., 1) at its nearest
        level: the model was conditioned on those values only. Others as they are."""
        def nearest(name: str, value: float) -> float:
            levels = self.levels.get(name)
            return min(levels, key=lambda level: abs(level - value)) if levels else value

        return {name: nearest(name, value) for name, value in scores.items()}

    def conditioned_prompt(self, messages: list[dict], scores: dict[str, float]) -> list[int]:
        unknown = sorted(set(scores) - set(self.objectives))
        if unknown or len(scores) != len(self.objectives):
            raise ValueError(f"scores {sorted(scores)}: give one for each objective {self.objectives}")
        ordered = {name: scores[name] for name in self.objectives}
        return self.encoder.prompt(with_scores(messages, ordered, self.scores_format))

    def generate(self, messages: list[dict], scores: dict[str, float], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None) -> list[int]:
        """Stage 2: the response's ids (up to EOS) to the prompt conditioned on `scores`."""
        prompt = self.conditioned_prompt(messages, scores)
        new = generate(self.model, prompt, max_new_tokens, temperature, top_p, greedy, self.encoder.eos, generator,
                       bos=self.encoder.bos)
        return new[:-1] if new and new[-1] == self.encoder.eos else new
