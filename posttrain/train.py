"""Post-training entry point: supervised fine-tuning, DPO or SGA of a checkpoint of this framework.

    python -m posttrain.train --config configs/sft_tiny.yaml [key=value ...]
    torchrun --nproc-per-node N -m posttrain.train --config CONFIG [key=value ...]

Everything but the model's loss and the data is pretraining's (pretrain.train.run): config checks,
process groups, the DeepSpeed engine with TP / EP / ZeRO, checkpoints, exact resume, logging.
"""

from __future__ import annotations

from pretrain import rank_logs

if __name__ == "__main__":
    rank_logs.quiet_other_ranks()

import gc  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data_prep.sources import BadInputReport  # noqa: E402
from models.config import ConfigError  # noqa: E402
from posttrain import records  # noqa: E402
from posttrain.batches import (  # noqa: E402
    ExampleBatches,
    PairExample,
    Row,
    collate_pairs,
    collate_rows,
    fixed_batches,
    pack,
    response_row,
)
from posttrain.chat import ChatEncoder, ChatFormat, ScoreFormat, with_scores  # noqa: E402
from posttrain.config import PostTrainConfig, example_length, validate_post  # noqa: E402
from pretrain.train import Task, main  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402


class PostTrainer(Trainer):
    """The pretraining loop over batch dicts (posttrain.batches)."""

    def forward(self, batch: dict) -> torch.Tensor:
        return self.engine({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})

    def probe_tokens(self, seq: int) -> torch.Tensor:
        return self.val_batches[0]["tokens"][:, :seq].to(self.device)


class Dataset:
    """The files of post.data or post.val_data, read, checked and tokenized once."""

    def __init__(self, cfg: PostTrainConfig, files: list[str], encoder: ChatEncoder, objectives: list[str] | None):
        self.report = BadInputReport()
        self.too_long = 0
        self.units: list = []
        self.objectives = objectives
        limit = example_length(cfg)
        post = cfg.post
        if post.method == "sft":
            rows = []
            for messages, _ in records.read(files, records.sft_messages, self.report):
                ids, trained = encoder.conversation(messages)
                if len(ids) > limit:
                    self.too_long += 1
                    continue
                rows.append(Row(ids, trained))
            if post.packing:  # the packing order is seeded, so the rows are the same at every start
                order = np.random.default_rng(cfg.train.seed).permutation(len(rows))
                rows = pack([rows[i] for i in order], limit)
            self.units = rows
            return
        scores_fmt = ScoreFormat.from_config(post)
        for pair, where in records.read(files, records.preference, self.report):
            if post.method == "sga":
                if not pair.scores:
                    self.report.add(where, "no 'scores' (post.method=sga trains on them)")
                    continue
                if self.objectives is None:  # the first record's objectives, in its order
                    self.objectives = list(pair.scores)
                if sorted(pair.scores) != sorted(self.objectives):
                    self.report.add(where, f"scores {sorted(pair.scores)} are not the objectives of the data "
                                           f"{sorted(self.objectives)}")
                    continue
                scores = {name: round(pair.scores[name], post.score_decimals) for name in self.objectives}
                prompt = encoder.prompt(with_scores(pair.prompt, scores, scores_fmt))
                raw_prompt = encoder.prompt(pair.prompt)
                target = np.array([scores[n] for n in self.objectives], dtype=np.float32)
            else:
                prompt = raw_prompt = encoder.prompt(pair.prompt)
                target = np.zeros(0, dtype=np.float32)
            chosen = response_row(prompt, encoder.response(pair.chosen))
            rejected = response_row(prompt, encoder.response(pair.rejected))
            if max(len(chosen.ids), len(rejected.ids)) > limit:
                self.too_long += 1
                continue
            self.units.append(PairExample(chosen, rejected, raw_prompt, target))


class PostTrainTask(Task):
    def __init__(self):
        self.train_data: Dataset | None = None
        self.val_data: Dataset | None = None
        self.meta_tokenizer: dict = {}

    def check(self, cfg: PostTrainConfig, world_size: int) -> dict:
        from data_prep.tokenizer import load_tokenizer
        from pretrain.config import validate

        validate(cfg, world_size)
        validate_post(cfg)
        try:
            sp, tokenizer = load_tokenizer(cfg.data.tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: {err}") from None
        if tokenizer["vocab_size"] != cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but the tokenizer {cfg.data.tokenizer} has "
                              f"{tokenizer['vocab_size']} tokens; set data.tokenizer to the model's tokenizer")
        encoder = ChatEncoder(sp, ChatFormat.from_config(cfg.post))
        self.train_data = Dataset(cfg, cfg.post.data, encoder, None)
        if not self.train_data.units:
            raise ConfigError(f"post.data={cfg.post.data} holds no usable {cfg.post.method} example "
                              f"({self.train_data.too_long} too long for post.max_len; "
                              f"{self.train_data.report.summary()})")
        dp = world_size // cfg.parallel.tensor
        if len(self.train_data.units) < cfg.train.micro_batch * dp:
            raise ConfigError(f"post.data has {len(self.train_data.units)} usable examples, fewer than one micro-batch "
                              f"on each data-parallel rank ({cfg.train.micro_batch} x {dp}); add examples or lower "
                              "train.micro_batch")
        self.val_data = Dataset(cfg, cfg.post.val_data, encoder, self.train_data.objectives)
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
        return {"tokenizer_sha256": tokenizer["sha256"], "eos_id": sp.eos_id()}

    def build_model(self, cfg: PostTrainConfig) -> torch.nn.Module:
        from posttrain.model import PostTrainModel
        from posttrain.value_head import spec
        from pretrain.distributed import device
        from pretrain.engine import use_bf16
        from pretrain.init_from import check_source, load_weights

        post = cfg.post
        head = spec(cfg.model.hidden_size, self.train_data.objectives, post) if post.method == "sga" else None
        model = PostTrainModel(cfg.model, post.method, post.beta, post.dpo_weight, post.mse_weight, head,
                               cfg.train.activation_checkpointing)
        if post.method != "sft":
            from models.gpt import GPT

            reference = GPT(cfg.model)
            load_weights(reference, check_source(cfg.train.init_from, cfg.to_dict()["model"], None))
            model.set_reference(reference.to(device(), torch.bfloat16 if use_bf16(cfg) else torch.float32))
        return model

    def load_init(self, model, path: Path) -> None:
        from pretrain.init_from import load_weights

        load_weights(model, path, optional=("value_head.",))

    def _collate(self, cfg: PostTrainConfig):
        limit = example_length(cfg)
        if cfg.post.method == "sft":
            return lambda rows: collate_rows(rows, self.pad_id, limit)
        return lambda pairs: collate_pairs(pairs, self.pad_id, limit)

    def batches(self, cfg: PostTrainConfig) -> ExampleBatches:
        from megatron.core import parallel_state as ps

        return ExampleBatches(self.train_data.units, self._collate(cfg), cfg.train.micro_batch,
                              ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), cfg.train.seed)

    def val_sets(self, cfg: PostTrainConfig) -> dict:
        from megatron.core import parallel_state as ps

        batches = fixed_batches(self.val_data.units, self._collate(cfg), cfg.train.micro_batch,
                                ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), cfg.train.eval_batches)
        return {"": batches} if batches else {}

    def meta(self, cfg: PostTrainConfig) -> dict:
        from posttrain.value_head import spec

        post = cfg.post
        info = {"method": post.method, "chat": ChatFormat.from_config(post).__dict__, "init_from": cfg.train.init_from,
                "examples": len(self.train_data.units), "too_long": self.train_data.too_long,
                "bad_records": self.train_data.report.to_dict()}
        meta = {"posttrain": info}
        if post.method == "sga":
            info["scores"] = ScoreFormat.from_config(post).__dict__
            info["value_head"] = spec(cfg.model.hidden_size, self.train_data.objectives, post)
            meta["heads"] = ["value_head"]
        return meta

    def trainer(self, cfg, engine, batches, val_sets, logger, meta, callbacks):
        from pretrain.distributed import device

        data = self.train_data
        logger.print(f"{cfg.post.method}: {len(data.units)} training "
                     f"{'rows' if cfg.post.method == 'sft' else 'pairs'} from {', '.join(cfg.post.data)} "
                     f"({data.too_long} longer than {example_length(cfg) - 1} tokens dropped); {data.report.summary()}"
                     + (f"; objectives {', '.join(data.objectives)}" if cfg.post.method == "sga" else ""))
        return PostTrainer(cfg, engine, batches, val_sets, logger, device(), meta, callbacks)


if __name__ == "__main__":
    exit_code = main(task=PostTrainTask(), config_class=PostTrainConfig)
    gc.freeze()  # as pretrain.train: skip the final collection of the loaded libraries
    sys.exit(exit_code)
