"""The policy being post-trained: the GPT itself (state dict keys unchanged, so every tool reads its
checkpoints) computing its method's loss from a batch dict (posttrain.batches), plus SGA's value head.

The frozen reference of DPO / SGA is a second GPT held outside the module tree: DeepSpeed neither
optimises, partitions nor saves it. Its log-probs are computed in the same step, under no_grad:
no pass over the data before training, no cache that a change of data or post.max_len would make
stale, and in bf16 its weights cost 2 bytes per parameter against the policy's ~16 (weights,
gradients, AdamW states); it is split over tensor/expert-parallel ranks like the policy (it is
not partitioned by ZeRO-3). The reference-free losses (post.preference_loss simpo, orpo) hold none.
"""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.gpt import GPT
from posttrain import losses
from posttrain.config import REFERENCE_FREE
from posttrain.value_head import ValueHead, last_token_states


class PostTrainModel(GPT):
    def __init__(self, cfg: ModelConfig, method: str, beta: float = 0.1, dpo_weight: float = 1.0,
                 mse_weight: float = 0.0, value_head: dict | None = None, activation_checkpointing="none",
                 preference_loss: str = "sigmoid", label_smoothing: float = 0.0, simpo_gamma: float = 0.0,
                 sft_weight: float = 0.0):
        super().__init__(cfg, activation_checkpointing=activation_checkpointing)
        self.method, self.beta, self.dpo_weight, self.mse_weight = method, beta, dpo_weight, mse_weight
        self.preference_loss, self.label_smoothing, self.simpo_gamma = preference_loss, label_smoothing, simpo_gamma
        # the chosen responses' SFT loss beside the preference loss: ORPO's own, or post.sft_weight's
        self.sft_weight = 1.0 if preference_loss == "orpo" else sft_weight
        if value_head is not None:
            self.value_head = ValueHead.from_spec(value_head)
        self._reference: list[GPT] = []  # a list: not a submodule

    def set_reference(self, reference: GPT) -> None:
        if self.preference_loss in REFERENCE_FREE:
            raise ValueError(f"preference_loss={self.preference_loss} measures the policy alone: no reference")
        reference.eval().requires_grad_(False)
        self._reference[:] = [reference]

    def _logprobs(self, model: GPT, batch: dict) -> torch.Tensor:
        tokens = batch["tokens"]
        ctx = {"token_mask": batch["real"]} if "real" in batch else {}
        if "documents" in batch:
            ctx["document_ids"] = batch["documents"]
        return losses.token_logprobs(model.logits(tokens[:, :-1], ctx), tokens[:, 1:])

    def predict_scores(self, prompt_tokens: torch.Tensor, prompt_last: torch.Tensor) -> torch.Tensor:
        """The value head on the raw prompts: [batch, objectives] in [0, 1]."""
        positions = torch.arange(prompt_tokens.shape[1], device=prompt_tokens.device)
        real = positions[None, :] <= prompt_last[:, None]
        hidden = self.hidden_states(prompt_tokens, {"token_mask": real})
        return self.value_head(last_token_states(hidden, prompt_last))

    def forward(self, batch: dict) -> torch.Tensor:
        metrics: dict[str, torch.Tensor] = {}
        trained = batch["trained"][:, 1:]
        prompt_aux = None
        if self.method == "sft":
            loss = losses.sft_loss(self._logprobs(self, batch), trained)
        else:
            loss = torch.zeros((), device=trained.device)
            if self.method == "sga" and self.mse_weight > 0:  # first: the raw prompts alone
                mse = losses.value_loss(self.predict_scores(batch["prompt_tokens"], batch["prompt_last"]),
                                        batch["scores"])
                loss = loss + self.mse_weight * mse
                metrics["value_mse"] = mse.detach()
                prompt_aux = self.aux_loss()  # the routers' balance on the prompts; the next forward replaces it
            mean = self.preference_loss in ("ipo", "simpo", "orpo")  # they compare per-token log-probs
            token_logprobs = self._logprobs(self, batch)
            policy = losses.sequence_logprobs(token_logprobs, trained, mean)
            pairs = policy.shape[0] // 2
            ref_chosen = ref_rejected = None  # SimPO and ORPO hold no reference
            if self.preference_loss not in REFERENCE_FREE:
                if not self._reference:
                    raise RuntimeError(f"preference_loss={self.preference_loss} needs the reference: set_reference")
                with torch.no_grad():
                    reference = losses.sequence_logprobs(self._logprobs(self._reference[0], batch), trained, mean)
                ref_chosen, ref_rejected = reference[:pairs], reference[pairs:]
            dpo, dpo_metrics = losses.dpo_loss(policy[:pairs], policy[pairs:], ref_chosen, ref_rejected, self.beta,
                                               self.preference_loss, self.label_smoothing, self.simpo_gamma)
            loss = loss + (self.dpo_weight if self.method == "sga" else 1.0) * dpo
            metrics.update(dpo_loss=dpo.detach(), **dpo_metrics)
            if self.sft_weight:  # SFT on the chosen responses beside the preference loss (ORPO's, RPO's)
                # nll_scale: this micro-batch's share of the step's chosen tokens (PostTrainer), so the
                # term is the mean over the step's tokens at any layout, as SFT's loss is
                nll = losses.sft_loss(token_logprobs[:pairs], trained[:pairs]) * batch.get("nll_scale", 1.0)
                loss = loss + self.sft_weight * nll
                metrics["nll_loss"] = nll.detach()
        self.last_metrics = metrics  # validation reports them too
        if self.training:
            aux = self.aux_loss()
            if self.method == "sft" and torch.is_tensor(aux):  # the part comparable with val/loss
                metrics["ce_loss"] = loss.detach()
            return loss + (aux if prompt_aux is None else (prompt_aux + aux) / 2)
        return loss
