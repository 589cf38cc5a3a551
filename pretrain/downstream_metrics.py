"""Downstream accuracy in the loop: the eval.downstream_tasks scored every eval.downstream_interval
steps and at the last step, logged as downstream/<task>/acc and acc_norm (pretrain.downstream)."""

from __future__ import annotations

from megatron.core import parallel_state as ps

from data_prep.sources import BadInputReport
from data_prep.tokenizer import load_tokenizer
from pretrain.config import Config
from pretrain.data import run_bos
from pretrain.downstream import evaluate_tasks, load_task, task_name
from pretrain.trainer import Callback


class DownstreamEval(Callback):
    def __init__(self, cfg: Config):
        e = cfg.eval
        self.interval = e.downstream_interval
        self.report = BadInputReport()
        self.tasks = {task_name(p): load_task(p, e.downstream_limit, self.report) for p in e.downstream_tasks}
        self.sp, _ = load_tokenizer(cfg.data.tokenizer)

    def on_train_begin(self, trainer, step: int) -> None:
        sizes = ", ".join(f"{name} {len(examples)}" for name, examples in self.tasks.items())
        trainer.logger.print(f"downstream tasks: {sizes} examples; {self.report.summary()}")

    def on_step_end(self, trainer, result) -> None:
        step = result.step
        if not trainer.periodic_due(step, self.interval, "downstream scoring"):
            return
        scores = evaluate_tasks(trainer.model, self.tasks, self.sp, trainer.cfg.train.micro_batch, trainer.device,
                                ps.get_data_parallel_group(), run_bos(trainer.cfg, trainer.meta))
        trainer.logger.scalars(step, {f"{name}/{key}": value for name, r in scores.items()
                                      for key, value in r.items() if key != "examples"}, prefix="downstream/")
        trainer.logger.print(f"step {step} | downstream " + ", ".join(
            f"{name} acc {r['acc']:.3f} (norm {r['acc_norm']:.3f})" for name, r in scores.items()))
