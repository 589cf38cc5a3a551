"""The training loop: step, validate, log, checkpoint, stop on signals or non-finite loss.

Cross-cutting concerns are callbacks; the loop itself stays small.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.attention.masks import document_ids
from pretrain import checkpoint, checkpoint_format, signals
from pretrain.batch_ramp import micro_batches_at
from pretrain.config import Config
from pretrain.data import Batches, all_batches, run_document_eos, split_batch
from pretrain.distributed import dp_mean
from pretrain.engine import invalid_global_norm, use_bf16
from pretrain.save_timer import SaveTimer
from pretrain.spikes import MAX_NONFINITE_IN_ROW, SpikeGuard
from pretrain.telemetry import Logger, Throughput, peak_memory_gb, progress_line, rank_extremes, reset_peak_memory


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class StepResult:
    step: int
    loss: float
    metrics: dict = field(default_factory=dict)


class Callback:
    """Hooks into the loop; override what you need. Every rank runs every hook."""

    def on_train_begin(self, trainer: Trainer, step: int) -> None:
        """Before the first step of this process; `step` is the last completed step (0, or the resumed one)."""

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        """Before train step `step` runs."""

    def on_optimizer_step(self, trainer: Trainer, step: int) -> None:
        """After step `step`'s optimizer update (and the model's own after-step updates), before
        its loss is reduced, validated or saved."""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        """After step `result.step` is logged and validated (result.metrics is set on log steps)."""

    def on_evaluate(self, trainer: Trainer, step: int, val: dict[str, float]) -> None:
        """After a completed validation at `step` ({"loss": ..., "<source>/loss": ...})."""

    def on_save(self, trainer: Trainer, step: int, path: Path) -> None:
        """After the checkpoint of `step` is complete on every rank."""

    def on_train_end(self, trainer: Trainer, step: int) -> None:
        """After the last step of this process: at train.steps, train.stop_at_step or a signal stop."""


class Trainer:
    def __init__(self, cfg: Config, engine, batches: Batches, val_sets: dict[str, list[torch.Tensor]],
                 logger: Logger, device: torch.device, meta: dict, callbacks: list[Callback] = ()):
        self.cfg = cfg
        self.engine = engine
        self.batches = batches
        self.val_sets = val_sets  # {data source name ("" for data.shards): fixed batches}
        self.logger = logger
        self.device = device
        self.meta = meta
        self.callbacks = list(callbacks)
        self.losses: list[tuple[int, float]] = []
        self.losses_written = 0  # how many of them RUN_DIR/losses.jsonl holds
        self.stopped_by_signal = 0  # the signal number when fit() saved and stopped on a signal
        self.last_metrics: dict[str, torch.Tensor] = {}  # the model's own metrics of the last step
        self.steps_not_applied = 0  # updates DeepSpeed's overflow check skipped (non-finite gradients)
        self.last_step_applied = True
        # data.document_mask: the EOS id that ends each document of a sample (from the manifest).
        self.document_eos: int | None = run_document_eos(cfg, meta)
        self.spikes: SpikeGuard | None = None
        # The step whose validation a signal interrupted: saved with its checkpoint, so the resumed
        # run validates those weights before it trains on.
        self.validation_due: int | None = None
        self.save_timer = SaveTimer(cfg.train.save_interval_minutes)
        # Tokens trained on by all ranks so far (in the checkpoint; None: resumed from one without it)
        self.tokens_seen: int | None = 0
        if cfg.train.skip_spikes:
            self.spikes = SpikeGuard(cfg.train.spike_window, cfg.train.spike_sigmas)
            zero = engine.optimizer  # DeepSpeed's ZeRO wrapper: it has the global norm before the torch step
            engine.basic_optimizer.should_skip = lambda: self.spikes.skip(
                float("nan") if invalid_global_norm(zero) else float(zero._global_grad_norm or 0.0))

    @property
    def model(self):
        return self.engine.module

    @property
    def val_batches(self) -> list[torch.Tensor]:
        return all_batches(self.val_sets)

    def probe_batch(self, seq: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The first `seq` input tokens of the first validation batch on the device (for metrics that
        look inside the model, such as attention sinks), with their document ids as training
        attends (None: the whole row) and the queries that are not padding (None: all)."""
        tokens = self.val_batches[0][:, :seq].to(self.device)
        return tokens, document_ids(tokens, self.document_eos), None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """The engine's loss on one micro-batch (inputs and shifted labels, documents when masked)."""
        inputs, labels = split_batch(batch, self.device)
        return self.engine(inputs, labels, document_ids(inputs, self.document_eos))

    def loss_tokens(self, batch) -> torch.Tensor | None:
        """How many tokens a micro-batch's loss averages over, where that differs between
        micro-batches (post-training's response tokens); None: all weigh the same."""
        return None

    def batch_tokens(self, batch) -> int | None:
        """Tokens a micro-batch runs through the model, where batches are not all full-length
        samples (post-training's padded rows); None: micro_batch x max_seq_len."""
        return None

    def val_weight(self, batch) -> torch.Tensor | None:
        """What a validation batch's loss weighs in the mean over the validation set (its loss
        tokens, or its examples where batches hold different numbers); None: all the same."""
        return self.loss_tokens(batch)

    # exp(val/loss) is a perplexity where the loss is the mean cross-entropy of tokens.
    reports_perplexity = True

    def val_metrics(self) -> dict[str, torch.Tensor]:
        """The model's own metrics of the validation batch just run, averaged like its loss into
        val/<name> (e.g. post-training's DPO rewards); none for the language-model loss."""
        return {}

    def micro_batch_weights(self, batches: list) -> list[float] | None:
        """Each micro-batch's share of the step's loss, so that a loss averaged over each micro-batch's
        tokens becomes the mean over all tokens of the step (every micro-batch of every data-parallel
        rank), whatever the micro-batch size, accumulation and data-parallel size: weight = tokens x
        micro-batches in the step / tokens in the step (DeepSpeed divides by the number of them)."""
        tokens = [self.loss_tokens(batch) for batch in batches]
        return None if tokens[0] is None else self.token_shares(tokens)

    def token_shares(self, tokens: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's tokens x micro-batches in the step / tokens in the step (all ranks'):
        the weight that turns a mean over its tokens into its part of the mean over the step's."""
        local = torch.stack([t.float() for t in tokens]).to(self.device)
        total = dp_mean(local.sum()) * ps.get_data_parallel_world_size()
        micro_batches = len(tokens) * ps.get_data_parallel_world_size()
        return [float(t) * micro_batches / max(total, 1.0) for t in local]

    def train_step(self, throughput: Throughput | None = None, micro_batches: int | None = None) -> torch.Tensor:
        """One optimizer step over `micro_batches` micro-batches (train.grad_accum unless a batch ramp
        says otherwise); returns the mean local loss."""
        micro_batches = micro_batches or self.cfg.train.grad_accum
        total = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor] = {}
        batches = []
        for _ in range(micro_batches):
            waited = time.perf_counter()
            batches.append(next(self.batches))
            if throughput is not None:
                throughput.data_wait(time.perf_counter() - waited)
        counted = [self.batch_tokens(batch) for batch in batches]
        if counted[0] is None:  # full-length samples
            counted = [batch.shape[0] * (batch.shape[1] - 1) for batch in batches]
        tokens = sum(counted) * ps.get_data_parallel_world_size()  # this rank's tokens x data-parallel size
        if self.tokens_seen is not None:
            self.tokens_seen += tokens
        if throughput is not None:
            throughput.step(tokens)
        weights = self.micro_batch_weights(batches)
        ramped = bool(self.cfg.train.batch_ramp_start)
        for micro, batch in enumerate(batches):
            if ramped:  # DeepSpeed would count micro-batches since the start in steps of its last size
                self.engine.set_gradient_accumulation_boundary(micro == micro_batches - 1)
            loss = self.forward(batch)
            if weights is not None:
                loss = loss * weights[micro]
            self.engine.backward(loss)
            total += loss.detach().float()
            if self.spikes is not None and micro == micro_batches - 1:
                self.spikes.begin_step(dp_mean(total / micro_batches))  # before the update
            self.engine.step()
            for name, value in self.model.last_metrics.items():  # e.g. the z-loss, part of the loss
                # weighted as the loss is: means over the step's tokens, as train/loss
                sums[name] = sums.get(name, 0.0) + value.float() * (1.0 if weights is None else weights[micro])
        self.last_metrics = {name: value / micro_batches for name, value in sums.items()}
        # Part of the optimizer step: validation and the checkpoint of this step see its result. A step
        # that changed no parameter (a spike, a non-finite norm, an fp16 overflow) moves nothing else.
        skipped = getattr(self.engine.basic_optimizer, "skipped", False)
        applied = self.last_step_applied = self.engine.was_step_applied()
        if not applied:  # DeepSpeed's overflow check skipped the update and held the schedule back
            self.engine.lr_scheduler.step()  # the rate follows the step count, as for a vetoed step
            self.steps_not_applied += 1
        self.model.after_optimizer_step(applied=applied and not skipped)
        return total / micro_batches

    def _check_non_finite(self, step: int, loss: float, skipped: bool) -> None:
        """A non-finite loss stops the run, unless train.skip_spikes is on and its update was skipped (by
        the guard or DeepSpeed's overflow check: the weights are as before it; a bad batch, which a
        resume would replay at the same step) fewer than MAX_NONFINITE_IN_ROW times in a row."""
        where = f"Resume from the last checkpoint in {checkpoint_format.checkpoint_dir(self.cfg.run.dir)}"
        if self.spikes is None:
            raise NonFiniteLossError(
                f"loss became {loss} at step {step}; nothing was saved for this step. {where} with a lower "
                "train.lr or stronger train.grad_clip; a bad batch (a resume meets it again at the same step: the "
                "sample order is exact) is skipped with train.skip_spikes=true")
        if not skipped or self.spikes.nonfinite >= MAX_NONFINITE_IN_ROW:
            raise NonFiniteLossError(
                f"loss became {loss} at step {step}, {self.spikes.nonfinite} step(s) in a row (their updates "
                f"skipped); nothing was saved for this step. {where} with a lower train.lr or stronger "
                "train.grad_clip")
        self.logger.print(f"step {step}: loss {loss}, update skipped: the run goes on with the weights as they were "
                          f"({self.spikes.nonfinite} such step(s) in a row; {MAX_NONFINITE_IN_ROW} stop it)")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """{"loss": over the training sources' validation batches, "<set>/loss": per data.mix source and
        eval.val_sets entry}; None without validation data or when a signal interrupted it. The
        held-out sets of eval.val_sets count in "loss" only where no training source has a val split."""
        if not self.val_batches:
            return None
        self.engine.eval()
        sums = torch.zeros(len(self.val_sets), device=self.device)
        counts = torch.zeros(len(self.val_sets), device=self.device)  # tokens, where batches weigh by them
        held_out = {s.name for s in self.cfg.eval.val_sets}
        overall = torch.tensor([name not in held_out for name in self.val_sets], device=self.device)
        if not overall.any():
            overall[:] = True
        metric_sums: dict[str, torch.Tensor] = {}  # val_metrics, over the sets "loss" covers
        weighted = False
        for i, batches in enumerate(self.val_sets.values()):
            for batch in batches:
                # Collective, so every rank leaves at the same batch (a forward pass may hold
                # tensor-parallel or ZeRO-3 collectives); an interrupted validation is not reported.
                if signals.any_rank_received(self.device):
                    self.engine.train()
                    return None
                tokens = self.val_weight(batch)
                weighted = tokens is not None
                weight = 1.0 if tokens is None else tokens.float().to(self.device)
                sums[i] += self.forward(batch).float() * weight
                for name, value in self.val_metrics().items() if overall[i] else ():
                    metric_sums[name] = metric_sums.get(name, 0.0) + value.float() * weight
                counts[i] += weight
        self.engine.train()
        n, names = len(self.val_sets), list(metric_sums)
        metrics = torch.stack([metric_sums[name] for name in names]) if names else sums[:0]
        if weighted:  # the ranks' mean sums over their mean counts: the mean over all ranks' tokens
            totals = torch.tensor(dp_mean(torch.cat([sums, counts, metrics])), dtype=torch.float64)
            sums, counts, metrics = totals[:n], totals[n:2 * n], totals[2 * n:]
            covered = counts[overall.cpu()].sum()
            means = [float(sums[overall.cpu()].sum() / covered), *(sums / counts).tolist(),
                     *(metrics / covered).tolist()]
        else:  # every rank has as many batches: the mean of the ranks' means
            covered = counts[overall].sum()
            means = dp_mean(torch.cat([sums[overall].sum(0, keepdim=True) / covered, sums / counts,
                                       metrics / covered]))
        result = {"loss": means[0]}
        # data.mix sources and eval.val_sets by name (data.shards, "", is what "loss" reports)
        result.update({f"{name}/loss": mean for name, mean in zip(self.val_sets, means[1:n + 1]) if name})
        result.update(zip(names, means[n + 1:]))
        return result

    def save(self, step: int) -> None:
        # First the losses of the steps it keeps: a crash after it then loses none of them (one
        # during it leaves steps that the resume trains again, written twice; the later counts).
        self.write_losses()
        started = time.perf_counter()
        rank_state = {"data": self.batches.state_dict(), "tokens_seen": self.tokens_seen}
        if self.spikes is not None:
            rank_state["spikes"] = self.spikes.state_dict()
        if self.validation_due == step:
            rank_state["validation_due"] = step
        path = checkpoint.save(self.engine, checkpoint_format.checkpoint_dir(self.cfg.run.dir), step, self.meta,
                               rank_state, self.cfg.train.keep_last, self.cfg.train.keep_every)
        self.save_timer.saved()
        seconds = time.perf_counter() - started
        if dist.get_rank() == 0:  # the files of all ranks, on the shared run directory
            size_gb = checkpoint.size_gb(path)
            self.logger.scalars(step, {"save_s": seconds, "size_gb": size_gb}, prefix="checkpoint/")
            self.logger.print(f"saved checkpoint step {step} ({size_gb:.2f} GB) in {seconds:.1f} s to {path}")
        self._emit("on_save", step, path)

    def write_losses(self) -> None:
        """Append the steps' losses not written yet to RUN_DIR/losses.jsonl (rank 0)."""
        if dist.get_rank() == 0 and self.losses_written < len(self.losses):
            with open(Path(self.cfg.run.dir) / "losses.jsonl", "a") as f:
                for step, loss in self.losses[self.losses_written:]:
                    f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        self.losses_written = len(self.losses)

    def load_rank_state(self, state: dict) -> None:
        """What save() kept besides the engine's state and the data position."""
        if self.spikes is not None and "spikes" in state:
            self.spikes.load_state_dict(state["spikes"])
        self.validation_due = state.get("validation_due")
        self.tokens_seen = state.get("tokens_seen")

    def periodic_due(self, step: int, interval: int, what: str) -> bool:
        """For callbacks: whether work done every `interval` steps and at the last step runs after
        `step`. Not while a stop signal waits for this step's save (the work could run past the
        time limit's grace); collective then, so every rank must ask at the same steps."""
        if step % interval and step != self.cfg.train.steps:
            return False
        if signals.any_rank_received(self.device):
            self.logger.print(f"step {step} | {what} skipped: stopping on a signal")
            return False
        return True

    def _emit(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def fit(self, start_step: int) -> int:
        """Train from `start_step` to `train.steps`; returns the last completed step."""
        if start_step == 0 and self.tokens_seen is None:  # a weights-only start (import_hf, ...) written before
            self.tokens_seen = 0
        self._emit("on_train_begin", start_step)
        step = self._train(start_step)
        self._emit("on_train_end", step)
        return step

    def _log(self, result: StepResult, lr: float, throughput: Throughput) -> None:
        result.metrics = {"loss": result.loss, "lr": lr, **throughput.measure(), "peak_memory_gb": peak_memory_gb()}
        reset_peak_memory()  # each log step reports the peak of its own interval
        if dist.get_world_size() > 1:
            result.metrics.update(rank_extremes(result.metrics, self.device))
        norm = self.engine.get_global_grad_norm()  # None where DeepSpeed does not compute it (ZeRO-0 in fp32)
        if norm is not None:  # a non-finite norm (the step was not applied) may come as -1
            result.metrics["grad_norm"] = float(norm) if float(norm) >= 0 else float("nan")
        if self.last_metrics:  # one collective for all; every rank has the same names
            result.metrics.update(zip(self.last_metrics, dp_mean(torch.stack(list(self.last_metrics.values())))))
        if self.spikes is not None:
            result.metrics["skipped_steps"] = len(self.spikes.skipped_steps)
        if self.tokens_seen is not None:
            result.metrics["tokens_seen"] = self.tokens_seen
        if self.cfg.train.batch_ramp_start:  # samples in the step (train.batch_ramp_*)
            result.metrics["global_batch"] = self.engine.train_batch_size()
        self.logger.scalars(result.step, result.metrics, prefix="train/")
        self.logger.print(progress_line(result.step, self.cfg.train.steps, result.metrics, tuple(self.last_metrics)))

    def _validate(self, step: int) -> None:
        if not self.val_batches:  # e.g. resumed without the val split: nothing is due any more
            self.validation_due = None
            return
        val = self.evaluate()
        self.validation_due = step if val is None else None  # None: a signal interrupted it
        if val is None:
            return
        perplexity = {"perplexity": math.exp(min(val["loss"], 50))} if self.reports_perplexity else {}
        self.logger.scalars(step, {**val, **perplexity}, prefix="val/")
        per_source = ", ".join(f"{k[:-5]} {v:.4f}" for k, v in val.items() if k.endswith("/loss"))
        others = "".join(f" | {k} {v:.4f}" for k, v in val.items() if k != "loss" and not k.endswith("/loss"))
        self.logger.print(f"step {step} | val loss {val['loss']:.4f}" + (f" ({per_source})" if per_source else "")
                          + others)
        self._emit("on_evaluate", step, val)

    def _stop_on_signal(self, step: int, signum: int, save: bool = True) -> None:
        if save:
            self.save(step)
        if dist.get_rank() == 0:
            checkpoint_format.write_stop_marker(self.cfg.run.dir, step, signals.signal_name(signum))
        dist.barrier()
        self.stopped_by_signal = signum
        why = (f"train.stop_after_minutes={self.cfg.train.stop_after_minutes:g} passed" if signum == signal.SIGALRM
               else signals.signal_name(signum))
        self.logger.print(f"stopping at step {step} on {why}; resume with train.resume=auto")

    def _train(self, start_step: int) -> int:
        t = self.cfg.train
        dp = ps.get_data_parallel_world_size()
        throughput = Throughput(t.micro_batch * t.grad_accum * self.cfg.model.max_seq_len * dp,
                                self.meta["flops_per_token"], dist.get_world_size(), use_bf16(self.cfg))
        step = start_step
        if self.validation_due == start_step:  # the checkpoint's validation, interrupted by the signal
            self.logger.print(f"step {start_step}: running the validation the stop interrupted")
            with throughput.paused():
                self._validate(start_step)
            if self.validation_due is not None:  # a signal interrupted it again: the checkpoint says so still
                self._stop_on_signal(start_step, signals.any_rank_received(self.device), save=False)
                return step
        if 0 < t.stop_at_step <= start_step:  # e.g. a requeue of the job that stopped there
            self.logger.print(f"resumed at step {start_step}, at or past train.stop_at_step={t.stop_at_step}: "
                              "nothing to train (raise or unset train.stop_at_step to go on)")
            return step
        if start_step >= t.steps:  # e.g. a finished run launched again
            where = " = train.steps, the run's end" if start_step == t.steps else f", past train.steps={t.steps}"
            self.logger.print(f"resumed at step {start_step}{where}: nothing to train (raise train.steps to go on)")
            return step
        while step < t.steps:
            self._emit("on_step_begin", step + 1)
            lr = self.engine.get_lr()[0]  # the rate this step applies; engine.step() moves to the next
            micro_batches = micro_batches_at(step + 1, t, dp)
            if micro_batches != self.engine.gradient_accumulation_steps():  # the ramp: the loss's 1 / count too
                self.engine.set_train_batch_size(micro_batches * t.micro_batch * dp)
            loss = self.train_step(throughput, micro_batches)
            step += 1
            if not self.last_step_applied:
                self.logger.print(f"step {step}: the gradients were not finite; update skipped "
                                  f"({self.steps_not_applied} so far in this process)")
            self._emit("on_optimizer_step", step)
            result = StepResult(step, dp_mean(loss))  # one collective and one host sync per step
            spike = ""
            if self.spikes is not None:
                if self.spikes.restarted:
                    self.logger.print(f"step {step}: {self.spikes.consecutive} updates in a row were spikes; "
                                      "applied, and the spike window starts over")
                if not self.last_step_applied:
                    self.spikes.refused(float(getattr(self.engine.optimizer, "_global_grad_norm", None) or float("nan")))
                spike = self.spikes.end_step(step)
                if spike:
                    self.logger.print(f"step {step}: update skipped as a spike ({spike}); "
                                      f"{len(self.spikes.skipped_steps)} skipped so far")
            if not math.isfinite(result.loss):
                self._check_non_finite(step, result.loss, skipped=bool(spike) or not self.last_step_applied)
            self.losses.append((step, result.loss))
            if step % t.log_interval == 0 or step == t.steps:
                self._log(result, lr, throughput)
            with throughput.paused():
                if step % t.eval_interval == 0 or step == t.steps:
                    self._validate(step)
                self._emit("on_step_end", result)
            signum = signals.any_rank_received(self.device)
            last = step == t.steps or step == t.stop_at_step
            # At the last step the plain stop below, unless the signal cut its validation short: then
            # as any signal stop, so that the rerun (a requeue) validates and trains nothing.
            if signum and (not last or self.validation_due == step):
                self._stop_on_signal(step, signum)
                return step
            save_now = step % t.save_interval == 0 or step == t.steps or step == t.stop_at_step
            if not save_now and self.save_timer.due(self.device):  # the same on every rank, so is save_now
                self.logger.print(f"step {step}: {t.save_interval_minutes:g} min since the last save "
                                  "(train.save_interval_minutes)")
                save_now = True
            if save_now:
                with throughput.paused():
                    self.save(step)
            if step == t.stop_at_step:
                self.logger.print(f"stopping at train.stop_at_step={step}")
                return step
        return step
