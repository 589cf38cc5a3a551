"""Convert a trained checkpoint to a LISA model: share attention scores in redundant layers.

    python -m tools.convert_lisa --checkpoint RUN/checkpoints/step_X --layers auto|sensitivity|3,4,5 \\
        --calib-shards DIR --out RUN_DIR [--steps N] [--qk-init zero|own|residual] [--loss-budget 0.05]

1. Loads the checkpoint into one process (any saved layout, see pretrain.consolidate).
2. On calibration batches (DIR/train) measures, for each layer l, how similar its attention maps
   are to layer l-1's after matching heads (greedy one-to-one matching on the per-head cosine
   similarity of the maps, averaged over the batch).
3. Chooses layers, never the first model.lisa.keep_full_layers, at most --max-fraction of them and
   (--max-chain N) never more than N LISA layers in a row:
   auto = similarity >= --threshold, most similar first (none reaching it: the most similar one, with a
   note); sensitivity = each candidate converted
   alone and its validation-loss increase measured, then least sensitive first while the measured
   increase of the whole set stays within --loss-budget (relative, before training); or the list.
4. Builds the LISA model: every weight copied; a LISA layer keeps V (from the fused QKV) and the
   output projection, starts its head alignment as the head permutation matched within each
   alignment group (model.lisa.align_group) and its low-rank Q/K as --qk-init says
   (models.attention.lisa_conversion: zero, own or residual).
5. Freezes everything but the new LISA parameters (alignment FFNs, low-rank Q/K), trains them
   --steps steps on DIR/train with the LM loss, and prints validation loss (DIR/val) of the
   original, the converted model before training and after, parameter counts, Q/K compression
   and the forward throughput change.

Writes RUN_DIR/converted (the converted model as a run directory of its own, its weights the step-0
checkpoint, as tools.import_hf writes one: tools.evaluate, export, generate and sink_report read it),
RUN_DIR/config.yaml (the source run's config with the new attention pattern and
train.init_from=RUN_DIR/converted/checkpoints/step_00000000, so `python -m pretrain.train --config
RUN_DIR/config.yaml` continues training the converted model at any layout) and RUN_DIR/conversion.json.
Single process, on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

from models import registry
from models.attention.lisa import qk_compression
from models.attention.lisa_conversion import (
    QK_INITS,
    build_lisa_model,
    conversion_problem,
    layer_similarity,
    lisa_config,
    new_parameters,
    propose_layers,
    sensitive_layers,
)
from models.attention.masks import document_ids
from models.config import ConfigError
from pretrain.checkpoint import save_weights_run
from pretrain.checkpoint_format import resolve_checkpoint
from pretrain.config import Config, missing_manifest_fix, read_manifest, save_config
from pretrain.consolidate import load_model, run_config
from pretrain.data import read_samples, run_bos, run_document_eos, starting_with
from tools.cli import ToolError, argument_parser, check_out_dir, reports_errors, run
from tools.evaluate import check_shards_tokenizer


@torch.no_grad()
def val_loss(model, rows: torch.Tensor, micro: int, eos: int | None = None) -> float:
    model.eval()
    losses = [float(model(b[:, :-1], b[:, 1:], document_ids(b[:, :-1], eos))) for b in rows.split(micro)]
    return sum(losses) / len(losses)


@torch.no_grad()
def forward_tokens_per_s(model, rows: torch.Tensor, eos: int | None = None, repeats: int = 3) -> float:
    model.eval()
    tokens = rows[:, :-1]
    documents = document_ids(tokens, eos)

    def ctx():  # a new one per forward, which fills it in
        return None if documents is None else {"document_ids": documents}

    model.logits(tokens, ctx())  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        model.logits(tokens, ctx())
    return repeats * tokens.numel() / (time.perf_counter() - t0)


def set_lisa_options(cfg, kinds: list[str], args, tensor: int) -> None:
    """model.lisa as the options ask, for a model that continues at the source run's tensor-parallel
    size: refused before any calibration pass where it could not."""
    asked = {"align_group": args.align_group, "align_hidden": args.align_hidden, "rank": args.rank}
    if "lisa" in kinds:  # every LISA layer has one shape: the ones there keep theirs
        changed = [f"--{k.replace('_', '-')} {v} (model.lisa.{k}={getattr(cfg.lisa, k)})"
                   for k, v in asked.items() if v is not None and v != getattr(cfg.lisa, k)]
        if changed:
            raise ToolError(f"{', '.join(changed)}: this model has LISA layers already, and these settings hold "
                            "for all of them; leave the options out to convert with the model's own")
    for key, value in asked.items():
        if value is not None:
            setattr(cfg.lisa, key, value)
    if args.keep_full_layers is not None:
        cfg.lisa.keep_full_layers = args.keep_full_layers
    per_rank = cfg.num_heads // tensor
    if args.align_group is None and cfg.lisa.align_group == 0 and tensor > 1 and "lisa" not in kinds:
        cfg.lisa.align_group = per_rank  # 0 means all heads, which would straddle the ranks
        print(f"note: alignment groups of the {per_rank} heads of each tensor-parallel rank (the run trained at "
              f"parallel.tensor={tensor}; --align-group sets another size)")
    group = cfg.lisa.resolved_group(cfg.num_heads)
    if group == cfg.num_heads > 1 and "lisa" not in kinds:
        print(f"note: one alignment group of all {group} heads, so the converted model runs at parallel.tensor=1 "
              f"only; --align-group G (a divisor of {group}) lets it run at tensor-parallel sizes up to {group}/G")
    if cfg.num_heads % group or per_rank % group:
        raise ToolError(f"--align-group {cfg.lisa.align_group}: groups of {group} heads must divide the {per_rank} "
                        f"heads of each tensor-parallel rank (the run trained at parallel.tensor={tensor}, "
                        f"{cfg.num_heads} heads); give a divisor of {per_rank}")
    sizes = registry.ParallelSizes(tensor=tensor, expert=1)
    try:  # the source's own layers under these settings (e.g. --keep-full-layers past a LISA layer)
        registry.validate_model(cfg, sizes)
        # and the LISA layers to come (rank, widths), which a source without one never checks
        registry.attention_kind("lisa").validate(cfg, kinds, sizes)
    except ConfigError as err:
        raise ToolError(f"the options make this model invalid: {err} (--rank, --align-hidden, --align-group and "
                        "--keep-full-layers set model.lisa.*)") from None


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--layers", default="auto", help="auto, sensitivity or comma-separated layer indices")
    parser.add_argument("--calib-shards", required=True, help="shards directory with train/ (and val/)")
    parser.add_argument("--out", required=True, help="run directory for the converted model")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out (its converted/, config.yaml and conversion.json)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--val-samples", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.6, help="auto: minimum matched map similarity (none reaching it: the most similar layer)")
    parser.add_argument("--max-fraction", type=float, default=None,
                        help="at most this share of layers (default 0.75 for auto, 0.84 for sensitivity: "
                             "the most the method's authors share)")
    parser.add_argument("--max-chain", type=int, default=0,
                        help="at most this many LISA layers in a row (0: any); 2 keeps every LISA layer "
                             "on the fused GPU kernel, which runs chains of up to two")
    parser.add_argument("--loss-budget", type=float, default=0.05,
                        help="sensitivity: largest relative validation-loss increase before training")
    parser.add_argument("--qk-init", choices=QK_INITS, default="own", help="the low-rank Q/K's start")
    parser.add_argument("--align-group", type=int, default=None, help="override model.lisa.align_group")
    parser.add_argument("--align-hidden", type=int, default=None,
                        help="override model.lisa.align_hidden (0: linear head mixing, attended as score features)")
    parser.add_argument("--rank", type=int, default=None, help="override model.lisa.rank (low-rank Q/K per head)")
    parser.add_argument("--keep-full-layers", type=int, default=None,
                        help="override model.lisa.keep_full_layers")
    parser.add_argument("--keep-chain-scores", action=argparse.BooleanOptionalAction, default=None,
                        help="model.lisa.keep_chain_scores of the converted model (default: on where LISA layers "
                             "follow each other)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    check_out_dir(out, {})
    if (out / "checkpoints").exists():
        raise ToolError(f"--out {out} holds checkpoints of a run: training there would resume them instead of "
                        "starting from the converted model; choose a new directory")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ToolError(f"--out {out} exists and is not empty (a run directory there would get another model's "
                        "config); choose a new directory or pass --overwrite")
    if args.max_chain < 0:
        raise ToolError(f"--max-chain {args.max_chain}: give a number of LISA layers in a row, or 0 for any")
    for option in ("micro_batch", "calib_batches", "val_samples"):
        if getattr(args, option) < 1:
            raise ToolError(f"--{option.replace('_', '-')} {getattr(args, option)}: give at least 1")
    if args.steps < 0 or not args.lr > 0:
        raise ToolError(f"--steps {args.steps} --lr {args.lr}: give steps >= 0 (0: no training) and a rate > 0")
    if args.max_fraction is not None and not 0 < args.max_fraction <= 1:
        raise ToolError(f"--max-fraction {args.max_fraction}: give the largest share of layers to convert, in (0, 1]")
    if not args.loss_budget >= 0:
        raise ToolError(f"--loss-budget {args.loss_budget}: give the largest relative loss increase, >= 0 "
                        "(0.05: 5%)")
    listed = None
    if args.layers not in ("auto", "sensitivity"):
        try:
            listed = sorted(int(x) for x in args.layers.split(",") if x.strip())
        except ValueError:
            raise ToolError(f"--layers {args.layers!r}: give auto, sensitivity or layer indices such as 4,5,7") from None
        twice = sorted({layer for layer in listed if listed.count(layer) > 1})
        if twice:
            raise ToolError(f"--layers {args.layers}: layer{'s' if len(twice) > 1 else ''} "
                            f"{', '.join(map(str, twice))} listed twice; name each layer once")

    shards = Path(args.calib_shards)
    if not (shards / "train" / "index.json").is_file():
        raise ToolError(f"--calib-shards {shards}: no train/index.json there; give the shards directory "
                        "a run trained on (the one with train/ and val/ that data_prep wrote)")
    if not (shards / "val" / "index.json").is_file():  # its rows would be the first ones trained on
        raise ToolError(f"--calib-shards {shards}: no val/ split, so the validation losses (and --layers "
                        "sensitivity) would be measured on the rows the conversion trains on; give shards with "
                        "a val/ split (data_prep.build_shards --val-fraction above 0)")
    if not (shards / "manifest.json").is_file():
        raise ToolError(f"--calib-shards {shards}: no manifest.json there; {missing_manifest_fix(shards)}")
    try:  # the calibration rows must be the model's tokens and fit its positions
        manifest = read_manifest(shards / "manifest.json", f"--calib-shards {shards}")
    except ConfigError as err:
        raise ToolError(str(err)) from None
    source, cfg, meta = load_model(args.checkpoint)
    check_calibration_shards(manifest, shards, cfg, meta)
    for p in source.parameters():
        p.requires_grad_(False)
    kinds = cfg.attention_kinds()
    run_cfg = run_config(resolve_checkpoint(args.checkpoint))
    set_lisa_options(cfg, kinds, args, run_cfg.parallel.tensor if run_cfg is not None else 1)
    keep = cfg.lisa.keep_full_layers
    if listed is not None:  # before the calibration passes
        problem = conversion_problem(kinds, listed, keep, args.max_chain)
        if problem:
            chain_only = conversion_problem(kinds, listed, keep) is None
            raise ToolError(f"--layers {args.layers}: {problem}; choose other layers"
                            + (" or a larger --max-chain" if chain_only else ""))
    else:
        problems = [conversion_problem(kinds, [layer], keep, args.max_chain) for layer in range(len(kinds))]
        if all(problems):
            raise ToolError(f"no layer of this {len(kinds)}-layer model can become a LISA layer: "
                            + "; ".join(problems) + f" (--keep-full-layers sets how many stay, {keep} now)")
    if args.max_fraction is None:
        args.max_fraction = 0.84 if args.layers == "sensitivity" else 0.75
    if args.layers in ("auto", "sensitivity") and int(args.max_fraction * len(kinds)) < 1:
        raise ToolError(f"--max-fraction {args.max_fraction} allows no layer of this {len(kinds)}-layer model; give at "
                        f"least {math.ceil(1000 / len(kinds)) / 1000}")
    bos = run_bos(run_cfg, meta)
    eos = run_document_eos(run_cfg, meta)  # as it trained

    def samples(split: str, count: int):  # as the run's loader gave them
        rows = read_samples(shards / split, count)
        return rows if bos is None else starting_with(rows, bos)

    calib = samples("train", args.calib_batches * args.micro_batch)
    val = samples("val", args.val_samples)

    calib_inputs = [b[:, :-1] for b in calib.split(args.micro_batch)]
    sim = layer_similarity(source, calib_inputs, [document_ids(b, eos) for b in calib_inputs])
    print(f"{'layer':>5} {'kind':<13} {'sim to l-1 (matched)':>20} {'(same index)':>12}  head match")
    for layer in range(len(kinds)):
        s = sim.get(layer)
        print(f"{layer:>5} {kinds[layer]:<13} " + (f"{s['similarity']:>20.4f} {s['unmatched']:>12.4f}  {s['match']}"
                                                   if s else f"{'-':>20} {'-':>12}"))
    rank = cfg.lisa.resolved_rank(cfg.head_dim)
    if args.qk_init != "zero" and cfg.head_dim % rank:
        print(f"note: --qk-init {args.qk_init} needs the rank ({rank}) to divide head_dim ({cfg.head_dim}); "
              "starting the low-rank Q/K at zero instead (choose --rank to keep it)")
        args.qk_init = "zero"
    sensitivity = None
    if args.layers == "auto":
        layers = propose_layers(sim, kinds, cfg.lisa.keep_full_layers, args.threshold, args.max_fraction,
                                args.max_chain)
        if len(layers) == 1 and sim[layers[0]]["similarity"] < args.threshold:
            print(f"note: no layer reaches --threshold {args.threshold}: converting the most similar one, layer "
                  f"{layers[0]} ({sim[layers[0]]['similarity']:.3f}); list layers or lower --threshold to choose")
    elif args.layers == "sensitivity":
        def loss_of(model):
            return val_loss(model, val, args.micro_batch, eos)

        layers, sensitivity = sensitive_layers(source, cfg, sim, loss_of, args.qk_init, args.loss_budget,
                                               args.max_fraction, args.max_chain)
        print("loss increase converting each layer alone: "
              + ", ".join(f"{layer}: {100 * v:+.2f}%" for layer, v in sensitivity.items()))
    else:
        layers = listed
    if not layers:
        if args.layers == "sensitivity":
            raise ToolError(f"no layer converted alone stays within --loss-budget {args.loss_budget}")
        # auto falls back to the most similar convertible layer: none of those the table measured is
        measured = [conversion_problem(kinds, [layer], keep, args.max_chain) for layer in sim]
        raise ToolError("no layer whose previous layer gives attention maps (the table's) can become a "
                        "LISA layer: " + "; ".join(p for p in measured if p))
    new_cfg = lisa_config(cfg, layers, args.keep_chain_scores)
    print(f"LISA layers: {layers}; attention {new_cfg.attention}; "
          f"keep_chain_scores {new_cfg.lisa.keep_chain_scores}")
    model = build_lisa_model(source, cfg, new_cfg, layers, sim, args.qk_init)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = new_parameters(model, layers)
    for p in trainable:
        p.requires_grad_(True)

    loss_source = val_loss(source, val, args.micro_batch, eos)
    loss_init = val_loss(model, val, args.micro_batch, eos)
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    model.train()
    train_rows = samples("train", max(args.steps, 1) * args.micro_batch)
    t0 = time.perf_counter()
    for step, batch in enumerate(train_rows.split(args.micro_batch)[: args.steps]):
        loss = model(batch[:, :-1], batch[:, 1:], document_ids(batch[:, :-1], eos))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}/{args.steps} | train loss {loss.item():.4f}", flush=True)
    train_s = time.perf_counter() - t0
    loss_after = val_loss(model, val, args.micro_batch, eos)

    n_source = sum(p.numel() for p in source.parameters())
    n_new = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in trainable)
    qk_source = len(layers) * cfg.hidden_size * (cfg.hidden_size + cfg.kv_width)  # Q and (grouped) K
    qk_new = sum(model.blocks[i].attn.qk.weight.numel() for i in layers)
    tps_source = forward_tokens_per_s(source, val[: args.micro_batch], eos)
    tps_new = forward_tokens_per_s(model, val[: args.micro_batch], eos)
    report = {
        "checkpoint": str(args.checkpoint), "layers": layers, "attention": new_cfg.attention,
        "qk_init": args.qk_init, "sensitivity": sensitivity,
        "similarity": {str(k): v for k, v in sim.items()},
        "val_loss": {"source": loss_source, "converted_init": loss_init, "converted_trained": loss_after},
        "steps": args.steps, "train_seconds": train_s,
        "params": {"source": n_source, "converted": n_new, "trained": n_train,
                   "trained_fraction": n_train / n_new},
        "qk_params": {"replaced_layers_source": qk_source, "replaced_layers_lisa": qk_new,
                      "compression": qk_source / max(qk_new, 1), "per_layer_compression": qk_compression(new_cfg)},
        "forward_tokens_per_s": {"source": tps_source, "converted": tps_new, "ratio": tps_new / tps_source},
    }
    print(f"val loss: source {loss_source:.4f} | converted, before training {loss_init:.4f} | "
          f"after {args.steps} steps {loss_after:.4f}")
    ratio = report["qk_params"]["compression"]
    print(f"params: {n_source:,} -> {n_new:,} ({100 * (n_new - n_source) / n_source:+.2f}%); trained {n_train:,} "
          f"({100 * n_train / n_new:.2f}%); Q/K in the {len(layers)} LISA layers {qk_source:,} -> {qk_new:,} "
          + (f"({ratio:.1f}x fewer)" if ratio >= 1 else f"({1 / ratio:.1f}x more at --rank {rank})"))
    print(f"forward throughput (this device, seq {val.shape[1] - 1}): {tps_source:,.0f} -> {tps_new:,.0f} tokens/s "
          f"({tps_new / tps_source:.2f}x)")

    out.mkdir(parents=True, exist_ok=True)
    source_run = run_config(Path(meta["checkpoint"]))
    full = source_run if source_run is not None else Config()  # a checkpoint copied without its run's config
    weights = write_converted(model, new_cfg, copy.deepcopy(full), meta, out / "converted", layers)
    full.model = new_cfg
    full.run.dir, full.run.name = str(out), out.name
    full.train.init_from, full.train.resume = str(weights), "auto"
    save_config(full, out / "config.yaml")
    (out / "conversion.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'converted'} (the converted model: --checkpoint for tools.evaluate, export, generate), "
          f"{out / 'conversion.json'}; continue training with {out / 'config.yaml'}"
          + ("" if source_run is not None else " (the source run's config.yaml was not found: set its data.* and "
                                                "train.* keys)"))
    return 0


def check_calibration_shards(manifest: dict, shards: Path, cfg, meta: dict) -> None:
    """Calibration rows the model can read as it was trained: its tokenizer, vocabulary, positions."""
    check_shards_tokenizer(shards, meta, "--calib-shards")
    if manifest.get("vocab_size", cfg.vocab_size) > cfg.vocab_size:
        raise ToolError(f"--calib-shards {shards}: built for {manifest['vocab_size']} tokens, more than the model's "
                        f"{cfg.vocab_size}; give shards built with its tokenizer")
    if manifest.get("seq_len", 0) > cfg.max_seq_len:
        raise ToolError(f"--calib-shards {shards}: sequences of {manifest['seq_len']} tokens, longer than the "
                        f"model's {cfg.max_seq_len} positions (model.max_seq_len); give shards built with "
                        f"data_prep.build_shards --seq-len {cfg.max_seq_len}")


READER_KEYS = ("tokenizer_sha256", "eos_id", "bos_id", "start_with_bos", "document_mask", "special_ids")


def write_converted(model, model_cfg, run_cfg: Config, source_meta: dict, out: Path, layers: list[int]) -> Path:
    """The converted model as a run directory whose step-0 checkpoint holds its weights
    (pretrain.checkpoint.save_weights_run); returns that checkpoint's directory."""
    run_cfg.model = model_cfg
    run_cfg.run.dir, run_cfg.run.name = str(out), out.name
    run_cfg.train.init_from, run_cfg.train.resume = "", "auto"
    for p in model.parameters():  # the engine's optimizer takes every weight, as training will
        p.requires_grad_(True)
    meta = {k: source_meta[k] for k in READER_KEYS if k in source_meta}
    return save_weights_run(model, run_cfg, out, {**meta, "lisa_layers": layers,
                                                  "converted_from": str(source_meta["checkpoint"])})


if __name__ == "__main__":
    run(main)
