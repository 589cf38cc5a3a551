"""Post-training entry point: supervised fine-tuning, DPO or SGA of a checkpoint of this framework.

    python -m posttrain.train --config RUN_DIR/config.yaml train.init_from=RUN_DIR post.method=sft \
        post.data=chat.jsonl run.dir=runs/sft [key=value ...]
    torchrun --nproc-per-node N -m posttrain.train --config CONFIG [key=value ...]

Everything but the model's loss and the data is pretraining's (pretrain.train.run): config checks,
process groups, the DeepSpeed engine with TP / EP / ZeRO, checkpoints, exact resume, logging.
"""

from __future__ import annotations

from pretrain import rank_logs, signals

if __name__ == "__main__":
    rank_logs.quiet_other_ranks()
    signals.install()  # a stop signal during the imports below waits for the first step boundary

import dataclasses  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from data_prep.readers import FileReadError  # noqa: E402
from models.config import ConfigError  # noqa: E402
from posttrain.batches import ExampleBatches, collate_pairs, collate_rows, fixed_batches  # noqa: E402
from posttrain.chat import (  # noqa: E402
    SCORE_KEYS,
    ChatEncoder,
    ChatFormat,
    ScoreFormat,
    inherit_chat_format,
    inherit_settings,
)
from posttrain.config import PostConfig, PostTrainConfig, example_length, validate_post  # noqa: E402
from posttrain.examples import Examples  # noqa: E402
from posttrain.value_head import VALUE_HEAD_SHAPE  # noqa: E402
from pretrain import checkpoint_format  # noqa: E402
from pretrain.consolidate import run_config  # noqa: E402
from pretrain.init_from import check_source, source_fingerprint, state_file  # noqa: E402
from pretrain.train import Task, main  # noqa: E402
from pretrain.trainer import Trainer  # noqa: E402


class PostTrainer(Trainer):
    """The pretraining loop over batch dicts (posttrain.batches)."""

    def forward(self, batch: dict) -> torch.Tensor:
        return self.engine({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})

    def loss_tokens(self, batch: dict) -> torch.Tensor | None:
        """SFT averages over response tokens, whose number varies between micro-batches; DPO and
        SGA average over pairs, as many in each."""
        return batch["trained"][:, 1:].sum() if self.cfg.post.method == "sft" else None

    def micro_batch_weights(self, batches: list) -> list[float] | None:
        """SFT's micro-batches weigh by their response tokens. DPO and SGA's pair losses weigh the
        same in each; the chosen responses' SFT term beside them (post.sft_weight, ORPO's) weighs by
        the chosen tokens, as a scale each batch carries to the model."""
        if self.cfg.post.method == "sft":
            return super().micro_batch_weights(batches)
        if self.model.sft_weight:
            chosen = [batch["trained"][:batch["tokens"].shape[0] // 2, 1:].sum() for batch in batches]
            for batch, share in zip(batches, self.token_shares(chosen)):
                batch["nll_scale"] = torch.tensor(share)
        return None

    def batch_tokens(self, batch: dict) -> int:
        """Every row the model runs (DPO and SGA: chosen and rejected), padded as it runs them."""
        return batch["tokens"][:, :-1].numel()

    def val_weight(self, batch: dict) -> torch.Tensor | None:
        """The validation set's last micro-batch may be smaller: pairs weigh by their number."""
        if self.cfg.post.method == "sft":
            return self.loss_tokens(batch)
        return torch.tensor(batch["tokens"].shape[0] // 2)

    @property
    def reports_perplexity(self) -> bool:  # DPO and SGA validate a pair loss, not a cross-entropy
        return self.cfg.post.method == "sft"

    def val_metrics(self) -> dict[str, torch.Tensor]:
        """DPO and SGA: the rewards, their margin and accuracy (and SGA's value MSE) of the pairs."""
        return dict(self.model.last_metrics) if self.cfg.post.method != "sft" else {}

    def probe_batch(self, seq: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Examples attend within themselves where packed; padding is no query."""
        batch = self.val_batches[0]
        documents = batch["documents"][:, :seq].to(self.device) if "documents" in batch else None
        inputs = batch["tokens"][:, :-1][:, :seq]  # as the model reads them: "documents" and "real" are theirs
        return inputs.to(self.device), documents, batch["real"][:, :seq].to(self.device)


POST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PostConfig)}  # "left at its default"


def cut_hint(cfg: PostTrainConfig) -> str:
    """Where examples are dropped for their length, the key that cuts them to fit instead."""
    if cfg.post.method == "sft":
        return {"drop": ": post.sft_truncation=keep_start or keep_end cuts them to fit",
                "keep_start": ": their prompts fill the row; post.sft_truncation=keep_end keeps their ends"
                }.get(cfg.post.sft_truncation, "")
    return ": post.max_prompt_len cuts long pairs to fit" if not cfg.post.max_prompt_len else ""


def method_name(cfg: PostTrainConfig) -> str:
    """The method, with its preference loss where that is not DPO's own."""
    post = cfg.post
    return post.method if post.method == "sft" or post.preference_loss == "sigmoid" else \
        f"{post.method} ({post.preference_loss})"


def truncation_key(cfg: PostTrainConfig) -> str:
    return f"post.sft_truncation={cfg.post.sft_truncation}" if cfg.post.method == "sft" else "post.max_prompt_len"


def check_reference(path: Path, fingerprint: str | None, method: str, run_dir: str) -> None:
    """A resumed DPO / SGA run measures its policy against the reference it started from: that
    checkpoint must still be there, holding the same weights (fingerprint: as the run recorded it;
    runs of earlier versions recorded none)."""
    if method == "sft":
        return
    fix = (f"restore it there, or start a new run.dir (the run in {run_dir} measured every loss against it); a "
           "base run that trains on removes its older checkpoints (train.keep_last): give train.init_from a "
           "checkpoint that stays, such as a copy or a tools.consolidate file")
    if not path.exists() or (path.is_dir() and not (path / checkpoint_format.COMPLETE).is_file()):
        raise ConfigError(f"the {method} run in {run_dir} compares its policy with the reference it started from, "
                          f"{path}, which is gone; {fix}")
    if fingerprint and source_fingerprint(path) != fingerprint:
        raise ConfigError(f"the {method} run in {run_dir} compares its policy with the reference it started from, "
                          f"{path}, which holds other weights since (written again after the run started); {fix}")


class PostTrainTask(Task):
    def __init__(self):
        self.train_data: Examples | None = None
        self.val_data: Examples | None = None
        # post keys (chat, score format, value head) taken from the start checkpoint, or differing from it
        self.start_notes: list[str] = []
        self.reference: Path | None = None  # the start checkpoint: DPO / SGA's frozen reference, if the loss has one
        self.reference_fingerprint: str | None = None  # init_from.source_fingerprint (DPO / SGA)

    def check(self, cfg: PostTrainConfig, world_size: int) -> dict:
        from data_prep.tokenizer import load_tokenizer
        from pretrain.config import EMPTY_TOKENIZER, validate

        validate(cfg, world_size)
        validate_post(cfg)
        if not cfg.data.tokenizer:
            raise ConfigError(f"{EMPTY_TOKENIZER} the model was trained with")
        try:
            sp, tokenizer = load_tokenizer(cfg.data.tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: {err}") from None
        if tokenizer["vocab_size"] != cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but the tokenizer {cfg.data.tokenizer} has "
                              f"{tokenizer['vocab_size']} tokens; set data.tokenizer to the model's tokenizer")
        if cfg.post.add_bos and sp.bos_id() < 0:
            raise ConfigError(f"post.add_bos=true but the tokenizer {cfg.data.tokenizer} has no BOS; set post.add_bos=false")
        # What the run started from: on a resume the reference and objectives the run began with.
        resume = checkpoint_format.resolve_resume(cfg.train.resume, cfg.run.dir)
        resumed_meta = checkpoint_format.read_meta(resume) if resume is not None else {}
        if resume is not None and "posttrain" not in resumed_meta and resumed_meta.get("optimizer_state") is not False:
            raise ConfigError(f"run.dir={cfg.run.dir} holds a pretraining run ({resume.name}): post-training would "
                              "resume its optimizer, learning-rate schedule and step; give that checkpoint as "
                              "train.init_from and choose a new run.dir")
        resumed = resumed_meta.get("posttrain", {})
        if resumed.get("method") and resumed["method"] != cfg.post.method:  # before its data is read as this method's
            raise ConfigError(f"post.method={cfg.post.method}: the run in {cfg.run.dir} is a {resumed['method']} "
                              f"run; set post.method={resumed['method']} to resume it, or start a new run.dir")
        if resumed.get("reference"):
            start = Path(resumed["reference"])
            self.reference_fingerprint = resumed.get("reference_fingerprint")
            if cfg.holds_reference_model():
                check_reference(start, self.reference_fingerprint, resumed["method"], cfg.run.dir)
        else:
            start = check_source(cfg.train.init_from, cfg.to_dict()["model"], tokenizer["sha256"])
            # recorded with a reference-free loss too: a resume may change post.preference_loss
            self.reference_fingerprint = source_fingerprint(start) if cfg.post.method != "sft" else None
        self.reference = start
        if resumed:  # the run recorded what it took from its start (an SFT run's start may be gone since)
            started, start_bos = resumed, None
        elif start.is_dir():
            start_run = run_config(start)
            started = checkpoint_format.read_meta(start).get("posttrain", {})
            start_bos = start_run is not None and start_run.data.start_with_bos
        else:  # weights written by tools.consolidate: the chat format and BOS of their run
            weights = state_file(start)
            started, start_bos = weights.get("posttrain", {}), weights.get("start_with_bos")
        objectives = started.get("value_head", {}).get("objectives") if cfg.post.method == "sga" else None
        # (add_bos among them: the start checkpoint's tokenizer is this one, checked above)
        self.start_notes = inherit_chat_format(cfg.post, started.get("chat"))
        if cfg.post.preference_loss == "simpo" and cfg.post.beta == PostConfig.beta:
            self.start_notes.append(f"post.beta={cfg.post.beta} with post.preference_loss=simpo: the SimPO paper "
                                    "trains with beta 2-2.5 and post.simpo_gamma 0.3-0.8 x beta")
        if not started.get("chat") and not cfg.post.add_bos and start_bos and sp.bos_id() >= 0:
            cfg.post.add_bos = True  # a pretrained (or imported) model whose samples began with BOS
            self.start_notes.append("post.add_bos=True: the start checkpoint's run began its samples with BOS "
                                    "(data.start_with_bos)")
        if not start.is_dir() and start_bos is None and not started:
            self.start_notes.append(f"train.init_from={start} records neither the chat format nor whether its "
                                    "samples began with BOS (tools.consolidate writes both): the post.* keys apply "
                                    "as given")
        if cfg.post.method == "sga" and started.get("scores"):  # the conditioning text the model learned
            self.start_notes += inherit_settings(cfg.post, started["scores"], SCORE_KEYS, POST_DEFAULTS,
                                                 "score format")
        if objectives:  # the value head goes on: its shape is the checkpoint's
            recorded = started["value_head"]
            self.start_notes += inherit_settings(cfg.post, recorded, VALUE_HEAD_SHAPE, POST_DEFAULTS,
                                                 "value head")
            changed = [f"post.{key}={getattr(cfg.post, key)} (the head's {recorded[name]})"
                       for name, key in VALUE_HEAD_SHAPE.items() if getattr(cfg.post, key) != recorded[name]]
            if changed:
                raise ConfigError(f"{', '.join(changed)}: SGA goes on with the value head of {start}, which has "
                                  "another shape; leave these keys out, or start a new head from the weights alone "
                                  "(python -m tools.consolidate writes them)")
        encoder = ChatEncoder(sp, ChatFormat.from_config(cfg.post))
        try:
            self.train_data = Examples(cfg, cfg.post.data, encoder, objectives,
                                       f"the value head of {start}, trained on" if objectives else "the data")
            self.val_data = Examples(cfg, cfg.post.val_data, encoder, self.train_data.objectives)
        except FileReadError as err:
            raise ConfigError(f"post.data / post.val_data: {err}") from None
        if not self.train_data.units:
            new_head = (f". SGA goes on with the value head of {start} and its objectives; for a new head on "
                        "other objectives, start from the weights alone (python -m tools.consolidate writes them)"
                        if objectives and not resumed else "")
            raise ConfigError(f"post.data={cfg.post.data} holds no usable {cfg.post.method} example "
                              f"({self.train_data.too_long} too long for post.max_len{cut_hint(cfg)}; "
                              f"{self.train_data.report.summary()}){new_head}")
        dp = world_size // cfg.parallel.tensor
        units = len(self.train_data.units)
        if units < cfg.train.micro_batch * dp:
            what = (f"{self.train_data.examples} usable examples, packed (post.packing) into {units} rows"
                    if cfg.post.packing else f"{units} usable examples")
            raise ConfigError(f"post.data has {what}, fewer than one micro-batch on each data-parallel rank "
                              f"({cfg.train.micro_batch} x {dp}); add examples or lower train.micro_batch"
                              + (" (or set post.packing=false)" if cfg.post.packing else "")
                              + f" ({self.train_data.too_long} too long for post.max_len{cut_hint(cfg)}; "
                              f"{self.train_data.report.summary()})")
        if resumed.get("data_sha256") and resumed["data_sha256"] != self.train_data.fingerprint():
            raise ConfigError(f"post.data (or post.max_len, post.max_prompt_len, post.sft_truncation, post.packing, "
                              "the chat or score "
                              "format) differs "
                              "from what the "
                              f"run in {cfg.run.dir} was training on, so it cannot resume its position; restore them, "
                              "or start a new run.dir")
        if resumed.get("data_seed", cfg.train.seed) != cfg.train.seed:  # the examples' order is drawn with it
            seed = resumed["data_seed"]
            raise ConfigError(f"train.seed={cfg.train.seed}: the run in {cfg.run.dir} was drawing its examples in "
                              f"the order of train.seed={seed}, so it cannot resume its position with another; set "
                              f"train.seed={seed}, or start a new run.dir")
        if cfg.post.val_data and not self.val_data.units:
            raise ConfigError(f"post.val_data={cfg.post.val_data} holds no usable {cfg.post.method} example "
                              f"({self.val_data.too_long} too long for post.max_len{cut_hint(cfg)}; "
                              f"{self.val_data.report.summary()})")
        if cfg.post.val_data and len(self.val_data.units) < dp:
            val_units = len(self.val_data.units)
            what = (f"{self.val_data.examples} usable examples, packed (post.packing) into {val_units} rows"
                    if cfg.post.packing else f"{val_units} usable examples")
            raise ConfigError(f"post.val_data has {what}, fewer than the {dp} data-parallel ranks, which validate "
                              "at least one each; add examples, or leave post.val_data out"
                              + (" (or set post.packing=false)" if cfg.post.packing else ""))
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
        # Examples start with BOS: recorded as pretraining records it, so generate, evaluate and export
        # (which read data.start_with_bos and the checkpoint's bos_id) add it too.
        cfg.data.start_with_bos = cfg.post.add_bos
        return {"tokenizer_sha256": tokenizer["sha256"], "eos_id": sp.eos_id(),
                **({"bos_id": sp.bos_id()} if cfg.post.add_bos else {})}

    def build_model(self, cfg: PostTrainConfig) -> torch.nn.Module:
        from posttrain.model import PostTrainModel
        from posttrain.value_head import spec
        from pretrain.distributed import device
        from pretrain.engine import use_bf16
        from pretrain.init_from import load_weights

        post = cfg.post
        head = spec(cfg.model.hidden_size, self.train_data.objectives, post) if post.method == "sga" else None
        model = PostTrainModel(cfg.model, post.method, post.beta, post.dpo_weight, post.mse_weight, head,
                               cfg.train.activation_checkpointing, post.preference_loss, post.label_smoothing,
                               post.simpo_gamma, post.sft_weight)
        if cfg.holds_reference_model():
            from models.gpt import GPT

            reference = GPT(cfg.model)
            load_weights(reference, self.reference)
            # in the policy's precision, as DeepSpeed runs the policy (its buffers stay fp32)
            model.set_reference(reference.to(device()).cast_parameters(torch.bfloat16 if use_bf16(cfg) else torch.float32))
        return model

    def share_sources(self, cfg: PostTrainConfig) -> None:  # its examples come from post.data, not shards
        from pretrain.distributed import rank_zero_value

        self.reference = Path(rank_zero_value(str(self.reference)))

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

    def resumed_data(self, cfg: PostTrainConfig, saved: dict, marker: dict, logger) -> dict:
        return saved  # ExampleBatches checks its own data (its size) when it loads the state

    def meta(self, cfg: PostTrainConfig) -> dict:
        from posttrain.value_head import spec

        post = cfg.post
        info = {"method": post.method, "chat": ChatFormat.from_config(post).__dict__, "init_from": cfg.train.init_from,
                "reference": str(self.reference), "reference_fingerprint": self.reference_fingerprint,
                "data_sha256": self.train_data.fingerprint(),
                "data_seed": cfg.train.seed,
                "examples": self.train_data.examples, "too_long": self.train_data.too_long,
                "truncated": self.train_data.truncated, "bad_records": self.train_data.report.to_dict()}
        if post.packing:
            info["packed_rows"] = len(self.train_data.units)
        if post.val_data:
            info["val"] = {"examples": self.val_data.examples, "too_long": self.val_data.too_long,
                           "truncated": self.val_data.truncated, "bad_records": self.val_data.report.to_dict()}
        meta = {"posttrain": info}
        if post.method == "sga":
            info["scores"] = ScoreFormat.from_config(post).__dict__
            info["value_head"] = spec(cfg.model.hidden_size, self.train_data.objectives, post)
            info["score_levels"] = self.train_data.score_levels()
            meta["heads"] = ["value_head"]
        return meta

    def trainer(self, cfg, engine, batches, val_sets, logger, meta, callbacks):
        from pretrain.distributed import device

        kind = "rows" if cfg.post.method == "sft" else "pairs"
        for note in self.start_notes:
            logger.print(f"note: {note}")
        for name, data, files in (("training", self.train_data, cfg.post.data), ("validation", self.val_data,
                                                                                cfg.post.val_data)):
            if files:
                logger.print(f"{method_name(cfg)}: {len(data.units)} {name} {kind} from {', '.join(files)} "
                             f"({data.too_long} dropped as longer than post.max_len={example_length(cfg) - 1} "
                             f"inputs and the last label{cut_hint(cfg) if data.too_long else ''}"
                             + (f", {data.truncated} cut to fit ({truncation_key(cfg)})" if data.truncated else "")
                             + "); "
                             f"{data.report.summary()}")
        if cfg.post.method == "sga":
            logger.print(f"sga: objectives {', '.join(self.train_data.objectives)}")
        return PostTrainer(cfg, engine, batches, val_sets, logger, device(), meta, callbacks)


if __name__ == "__main__":
    exit_code = main(task=PostTrainTask(), config_class=PostTrainConfig)
    gc.freeze()  # as pretrain.train: skip the final collection of the loaded libraries
    sys.exit(exit_code)
