"""Training entry point.

    python -m pretrain.train --config configs/tiny_dense.yaml train.steps=100 parallel.tensor=2

Run under torchrun or srun (one process per device); a single process runs without either.
"""

from __future__ import annotations

from pretrain import rank_logs, signals

if __name__ == "__main__":  # before the imports below, which print their warnings on every rank
    rank_logs.quiet_other_ranks()
    signals.install()  # a stop signal during the imports below waits for the first step boundary

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from models import registry  # noqa: E402
from pretrain import checkpoint, checkpoint_format, run_lock  # noqa: E402
from pretrain.config import (  # noqa: E402
    Config,
    ConfigError,
    DataConfig,
    inert_settings,
    load_config,
    save_config,
    switched_on,
    validate,
    validate_data,
)
from pretrain.distributed import (  # noqa: E402
    destroy_distributed,
    device,
    init_distributed,
    rank_zero_value,
    read_env,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (defaults apply to anything it leaves out)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 model.num_layers=4")
    return parser.parse_args(argv)


def global_batch(cfg: Config, world_size: int) -> int:
    return cfg.train.micro_batch * cfg.train.grad_accum * (world_size // cfg.parallel.tensor)


class Task:
    """What a run trains: the model, its data and its loop. This one pretrains on streaming shards;
    other entry points (posttrain.train) subclass it and share the rest of `run`: checks, process
    groups, engine, checkpoints, resume, logging and callbacks."""

    def check(self, cfg: Config, world_size: int) -> dict:
        """Config and data checks before any process group; returns the data's manifest
        (tokenizer_sha256, eos_id, ...)."""
        validate(cfg, world_size)
        return validate_data(cfg, world_size)

    def build_model(self, cfg: Config) -> torch.nn.Module:
        from models.gpt import GPT

        return GPT(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing, z_loss=cfg.train.z_loss)

    def load_init(self, model: torch.nn.Module, path: Path) -> None:
        """train.init_from: the weights a new run starts from."""
        from pretrain.init_from import load_weights

        load_weights(model, path)

    def batches(self, cfg: Config):
        from pretrain.data import Batches, build_loader

        return Batches(build_loader(cfg, "train", shuffle=True))

    def val_sets(self, cfg: Config) -> dict:
        from pretrain.data import load_val_sets

        return load_val_sets(cfg)

    def share_sources(self, cfg: Config) -> None:
        """After the process groups exist: what this task resolved on each rank on its own (besides
        train.init_from), as rank 0 resolved it: here the remote shard indexes."""
        from pretrain.data import share_remote_indexes

        share_remote_indexes(cfg)

    def meta(self, cfg: Config) -> dict:
        """Entries of the checkpoint marker besides the model's, the tokenizer's and the layout's."""
        from pretrain.data import sources_record

        return {"data_sources": sources_record(cfg)}

    def resumed_data(self, cfg: Config, saved: dict, marker: dict, logger) -> dict:
        """The train loader's state to resume from (the checkpoint's, unless the data changed)."""
        from pretrain.data import resumed_position

        state, why = resumed_position(saved, marker, cfg)
        if why:
            logger.print(why)
        # The saved order goes on (a seed changed mid-epoch would revisit samples or skip them).
        kept = [f"data.{key}={getattr(cfg.data, key)} (the run's is {saved[key]})"
                for key in ("shuffle_seed", "num_canonical_nodes") if key in saved and saved[key] != getattr(cfg.data, key)]
        if kept:
            logger.print(f"note: {', '.join(kept)}: the resumed run goes on in the sample order of its checkpoint; "
                         "a new order needs a new run.dir")
        if marker.get("start_with_bos") not in (None, cfg.data.start_with_bos):
            logger.print(f"note: data.start_with_bos={cfg.data.start_with_bos} where the checkpoint trained with "
                         f"{marker['start_with_bos']}: from here on its samples "
                         f"{'begin with BOS' if cfg.data.start_with_bos else 'no longer begin with BOS'}")
        return state

    def trainer(self, cfg: Config, engine, batches, val_sets: dict, logger, meta: dict, callbacks: list):
        from pretrain.trainer import Trainer

        return Trainer(cfg, engine, batches, val_sets, logger, device(), meta, callbacks)


def check_run_dir(run_dir: str) -> None:
    """A run directory the run can write: not empty (an unset shell variable would make it the
    current directory), not a file, and its nearest existing folder writable."""
    if not run_dir.strip():
        raise ConfigError("run.dir is empty (an unset variable?): give the run's directory, e.g. run.dir=runs/NAME")
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={run_dir} is a file: give a directory (new, or a run's to resume)")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir={run_dir}: {existing} is not writable here; give a directory this user can "
                          "write")


def prepare(cfg: Config, world_size: int, task: Task | None = None) -> tuple[dict, Path | None, Path | None, bool]:
    """Every check that needs no process group: config, data, tokenizer, checkpoints.
    Returns (manifest, checkpoint to resume, checkpoint whose weights to start from, whether the
    resume goes through a universal checkpoint because the layout changed)."""
    manifest = (task or Task()).check(cfg, world_size)
    check_run_dir(cfg.run.dir)
    resume_path = checkpoint_format.resolve_resume(cfg.train.resume, cfg.run.dir)
    if resume_path is not None:
        from pretrain.consolidate import ConsolidateError, describe_layout
        from pretrain.engine import use_bf16

        meta = checkpoint_format.read_meta(resume_path)
        try:  # every file there, before anything is built (a partial copy keeps its COMPLETE marker)
            describe_layout(resume_path, meta, with_optimizer=True)
        except ConsolidateError as err:
            raise checkpoint_format.CheckpointError(f"train.resume={cfg.train.resume}: {err} "
                                                    "(train.resume=<checkpoint>)") from None
        checkpoint.check_compatible(meta, cfg.to_dict()["model"], manifest.get("tokenizer_sha256"), resume_path)
        routed = registry.mlp_kind(cfg.model.mlp).routed
        universal = checkpoint_format.check_layout(meta, world_size, cfg.parallel.tensor, global_batch(cfg, world_size),
                                                   routed, resume_path, cfg.parallel.zero_stage, use_bf16(cfg))
        return manifest, resume_path, None, universal
    if cfg.train.init_from:
        from pretrain.init_from import check_source

        init_path = check_source(cfg.train.init_from, cfg.to_dict()["model"], manifest.get("tokenizer_sha256"))
        own = checkpoint_format.checkpoint_dir(cfg.run.dir).resolve()
        if cfg.train.resume == "none" and own in Path(init_path).resolve().parents:
            raise checkpoint_format.CheckpointError(
                f"train.init_from={cfg.train.init_from} is a checkpoint of run.dir itself, which "
                "train.resume=none sets aside before training: start the new run in another run.dir")
        return manifest, None, init_path, False
    return manifest, None, None, False


def schedule_rise(marker: dict, cfg: Config, step: int) -> str | None:
    """A note when this config's schedule gives the next step a clearly higher rate than the one the
    checkpoint was trained towards (a wsd run resumed with more steps after its decay began)."""
    from pretrain.config import TrainConfig
    from pretrain.schedule import lr_multiplier

    saved = marker.get("schedule")
    if not saved:
        return None
    before = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__})
    was, now = before.lr * lr_multiplier(step, before), cfg.train.lr * lr_multiplier(step, cfg.train)
    if now <= 1.2 * was:
        return None
    return (f"note: step {step + 1} trains at lr {now:.3g}, where the checkpoint's schedule (train.steps="
            f"{before.steps}, {before.schedule}) was at {was:.3g}: a wsd run extends without re-warming only "
            "before its decay begins")


def run(cfg: Config, task: Task | None = None) -> int:
    """Train per `cfg` (pretraining unless `task` says otherwise); returns the process exit code."""
    from models.counting import flops_per_token, param_counts
    from pretrain.callbacks import build_callbacks
    from pretrain.engine import DECAY_GROUPS, build_engine, describe_optimizer, use_bf16
    from pretrain.telemetry import Logger

    task = task or Task()
    env = read_env()
    # First: a time-limit signal during startup (a universal conversion can take minutes) is then kept
    # for the first step boundary, where the run saves and stops, instead of killing the process.
    signals.install()
    if cfg.train.stop_after_minutes:  # counted from here: the start, a conversion and the resume included
        signals.stop_after(cfg.train.stop_after_minutes * 60)
    manifest, resume_path, init_path, universal = prepare(cfg, env.world_size, task)
    # Rank 0 holds run.dir before anything is written there (a universal conversion, the config).
    in_use = (run_lock.hold(Path(cfg.run.dir)) or "") if env.rank == 0 else ""
    if universal:  # another layout: the checkpoint in DeepSpeed's layout-free form, converted once
        from pretrain.universal import convert, wait_converted

        if in_use:  # its launcher stops the ranks that wait for the conversion
            raise ConfigError(in_use)
        universal = convert(resume_path, cfg.run.dir) if env.rank == 0 else wait_converted(resume_path, cfg.run.dir)
    init_distributed(cfg.parallel.tensor, cfg.parallel.expert)
    # A run directory as train.init_from means its newest checkpoint, which a run still saving
    # moves: every rank starts from the one rank 0 found.
    if init_path is not None:
        init_path = Path(rank_zero_value(str(init_path)))
    task.share_sources(cfg)
    run_dir = Path(cfg.run.dir)
    in_use = rank_zero_value(in_use)
    if in_use:
        raise ConfigError(in_use)
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        # As relaunching it resumes the run: a train.resume given for this start (a rollback to an
        # older checkpoint, none) would set the newer checkpoints aside again at every relaunch.
        save_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="auto")),
                    run_dir / "config.yaml")
        checkpoint_format.clear_run_markers(run_dir)  # markers describe the latest process run only
        if cfg.train.resume != "auto":  # none, or a checkpoint: no later tag may stay to be resumed or kept
            moved = checkpoint_format.set_aside_newer(run_dir, resume_path)
            if moved:
                if resume_path is not None and checkpoint_format.own_tag(run_dir, resume_path):
                    why = f"resuming the older {resume_path.name}: set aside the later checkpoints"
                else:
                    why = f"starting {'afresh' if resume_path is None else f'from {resume_path}'}: " \
                          "set aside the checkpoints"
                print(f"{why} {', '.join(moved)} in "
                      f"{checkpoint_format.checkpoint_dir(run_dir) / checkpoint_format.ABANDONED}", flush=True)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = task.build_model(cfg)
    if init_path is not None:
        task.load_init(model, init_path)
    if switched_on(cfg.train.compile):
        model.compile_blocks()
    # A run keeps the weight-decay groups it started with: its optimizer state is laid out by them.
    marker = checkpoint_format.read_meta(resume_path) if resume_path is not None else {}
    fresh_optimizer = resume_path is None or marker.get("optimizer_state") is False  # weights only: import_hf
    decay_groups = DECAY_GROUPS if fresh_optimizer else marker.get("decay_groups", 1)
    engine = build_engine(cfg, model, load_universal=bool(universal), decay_groups=decay_groups)
    batches = task.batches(cfg)
    counts = param_counts(cfg.model)
    meta = {"model": cfg.to_dict()["model"], "tokenizer_sha256": manifest.get("tokenizer_sha256"),
            "eos_id": manifest.get("eos_id"), "bos_id": manifest.get("bos_id"),
            # for readers of a checkpoint without its config.yaml
            "start_with_bos": cfg.data.start_with_bos, "document_mask": cfg.data.document_mask,
            "bf16": use_bf16(cfg),  # train.precision resolved (auto: bf16 on a GPU)
            "flops_per_token": flops_per_token(cfg.model), "params": counts,
            "global_batch": global_batch(cfg, env.world_size), "decay_groups": decay_groups,
            "schedule": dataclasses.asdict(cfg.train), **task.meta(cfg)}
    logger = Logger(run_dir, env.rank, start_step=marker["step"] if resume_path is not None else 0)
    if decay_groups < DECAY_GROUPS and any(getattr(p, "no_weight_decay", False) for p in model.parameters()):
        logger.print("resumed with the weight-decay groups the checkpoint's optimizer state has: LISA's head "
                     "mixing and biases decay as when the run started (a new run leaves them undecayed)")
    logger.print(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active), "
                 f"world {env.world_size} = tensor {cfg.parallel.tensor} x data "
                 f"{env.world_size // cfg.parallel.tensor} (expert {cfg.parallel.expert}), "
                 f"ZeRO-{cfg.parallel.zero_stage}, {describe_optimizer(engine, cfg.train.skip_spikes)}")
    for line in inert_settings(cfg):
        logger.print(line)
    for name in registry.unread_sections(cfg.model):
        logger.print(f"note: model.{name}.* is set, but no layer of this model reads it (model.attention="
                     f"{cfg.model.attention}, model.mlp={cfg.model.mlp}): it changes nothing")
    if cfg.data.mix:
        sources = cfg.data.sources
        total = sum(source.weight for source in sources)
        logger.print("data mixture: " + ", ".join(f"{s.name} {100 * s.weight / total:.1f}% ({s.shards})"
                                                  for s in sources)
                     + (f"; data.shards={cfg.data.shards} is not read" if cfg.data.shards != DataConfig.shards else ""))
    start_step = 0
    if init_path is not None:
        logger.print(f"started from the weights of {init_path}")
    if resume_path is not None:
        state = checkpoint.load(engine, resume_path, universal or None)
        batches.load_state_dict(task.resumed_data(cfg, state["data"], marker, logger))
        start_step = marker["step"]
        logger.print(f"resumed from {resume_path} at step {start_step}"
                     + (f" on another layout, through {universal}" if universal else ""))
        if cfg.train.init_from and "posttrain" not in marker:  # post-training names its start in every run
            logger.print(f"note: train.init_from={cfg.train.init_from} is not read: it sets a new run's weights, "
                         "and this run resumes its own checkpoint (train.resume=none starts it over from init_from)")
        if not universal and marker.get("optimizer_state", True) and not checkpoint.restores_optimizer(marker):
            logger.print(f"note: the checkpoint was saved at world {marker.get('world_size')}, expert-parallel size "
                         f"{marker.get('expert_parallel', 1)}, this run is at world {env.world_size}, "
                         f"{cfg.parallel.expert}: AdamW's moments start afresh (the weights, the schedule and the "
                         "data position are restored"
                         + ("; the fp32 master weights from the bf16 ones)" if use_bf16(cfg) else ")"))
        rise = schedule_rise(marker, cfg, start_step)
        if rise:
            logger.print(rise)
        batch, saved_batch = global_batch(cfg, env.world_size), marker.get("global_batch")
        if saved_batch not in (None, batch):  # at the saved layout (another layout refuses it)
            logger.print(f"note: the checkpoint trained with a global batch of {saved_batch} samples; from step "
                         f"{start_step + 1} each step takes {batch} (train.micro_batch x train.grad_accum x "
                         "data-parallel size), the learning-rate schedule still counting steps")
    trainer = task.trainer(cfg, engine, batches, task.val_sets(cfg), logger, meta, build_callbacks(cfg, model))
    if resume_path is not None:
        trainer.load_rank_state(state)
    trainer.fit(start_step)
    trainer.write_losses()
    logger.close()
    return signals.EXIT_CODE_SAVED_ON_SIGNAL if trainer.stopped_by_signal else 0


def main(argv: list[str] | None = None, task: Task | None = None, config_class: type = Config) -> int:
    args = parse_args(argv)
    cfg = None
    try:
        cfg = load_config(args.config, args.overrides, config_class)
        rank_logs.settle(cfg.run.dir)
        code = run(cfg, task)
    except (ConfigError, checkpoint_format.CheckpointError) as err:
        # On the terminal from every rank: torchrun may stop rank 0 before it prints, once another
        # rank has exited with the same error.
        rank_logs.to_console(f"error: {err}")
        rank_logs.discard_unsettled()
        return 2
    except Exception as err:  # a failure mid-run: the run directory says what ended it (launch.status)
        if cfg is not None and Path(cfg.run.dir, "config.yaml").is_file():
            checkpoint_format.write_failure_marker(cfg.run.dir, read_env().rank, err)
        raise
    finally:
        destroy_distributed()
        run_lock.release()
    return code


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    exit_code = main()
    # Leave the loaded libraries (torch, DeepSpeed, megatron) out of the interpreter's final garbage
    # collection: it takes several seconds per process and only frees memory the OS reclaims anyway.
    gc.freeze()
    sys.exit(exit_code)
