"""Validation loss and perplexity of a checkpoint on any shard set, and its accuracy on multiple-choice
downstream tasks, in one process.

    python -m tools.evaluate --checkpoint RUN_DIR[/checkpoints/TAG] --shards DIR \\
        [--split val] [--batches 8] [--batch-size 4]
    python -m tools.evaluate --checkpoint RUN_DIR --tasks hellaswag.jsonl arc_easy.jsonl [--limit N] \\
        [--tokenizer DIR]

--shards is a shard directory holding the split (DIR/val/index.json) or a split directory itself
(DIR/index.json). Samples are read in order, batch b holding samples [b*B, (b+1)*B) (each once: a
smaller split gives fewer full batches, which the output notes; the trainer's validation reads
whole rounds of micro_batch x data-parallel size there), so `--batches N --batch-size B` covers
the same N*B samples the trainer's validation covers with train.eval_batches * data-parallel
size = N and micro_batch = B; the loss is
the trainer's (mean next-token cross-entropy over the padded vocabulary, no auxiliary losses; within
documents when the run trained with data.document_mask, which its config.yaml says, or the checkpoint
away from it). Prints `loss L | perplexity P | tokens T`; --json prints a JSON object instead.

--tasks scores JSON Lines multiple-choice tasks (HellaSwag, ARC, PIQA shapes or {"context", "choices",
"gold"}; pretrain.downstream) as the trainer does with eval.downstream_tasks: acc (summed
log-likelihood) and acc_norm (per character), with the run's tokenizer (data.tokenizer in its
config.yaml, or --tokenizer).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from megatron.core import tensor_parallel

from models.attention.masks import document_ids
from pretrain.checkpoint_format import read_meta, resolve_checkpoint
from pretrain.consolidate import load_model, run_config
from pretrain.data import read_samples, run_bos, run_document_eos, starting_with
from pretrain.downstream import empty_task_error, evaluate_tasks, load_task, task_name
from tools.cli import ToolError, argument_parser, reports_errors, run, tool_device


def split_dir(shards: str | Path, split: str, choose: str = "") -> Path:
    """The split directory of a shards directory (or the split directory itself). `choose`: the
    flag that picks another split, named when the shards have other splits but not this one."""
    shards = Path(shards)
    if (shards / "index.json").is_file():
        return shards
    if (shards / split / "index.json").is_file():
        return shards / split
    others = sorted(d.parent.name for d in shards.glob("*/index.json"))
    if others:  # shards built with --val-fraction 0 have no val split
        raise ToolError(f"--shards {shards} has no {split} split, only {', '.join(others)}"
                        + (f": choose one with {choose}" if choose else ""))
    raise ToolError(f"--shards {shards}: neither {shards / split / 'index.json'} nor {shards / 'index.json'} "
                    "exists; point at a directory written by data_prep.build_shards (or its split)")


@torch.no_grad()
def evaluate_rows(model, rows: torch.Tensor, batch_size: int, eos_id: int | None = None) -> dict:
    """The trainer's validation loss over ``rows``; ``eos_id``: attend within documents, as a run with
    data.document_mask does."""
    seq = rows.shape[1] - 1
    if seq > model.cfg.max_seq_len:
        raise ValueError(f"samples hold {seq} tokens but model.max_seq_len={model.cfg.max_seq_len}")
    if int(rows.max()) >= model.cfg.vocab_size:
        raise ValueError(f"the shards hold token id {int(rows.max())} >= model.vocab_size={model.cfg.vocab_size}: "
                         "they were built with another tokenizer")
    losses, sizes = [], []
    device = next(model.parameters()).device
    for batch in rows.split(batch_size):
        sizes.append(len(batch))
        batch = batch.to(device)
        inputs = batch[:, :-1]
        logits = model.logits(inputs, {"document_ids": document_ids(inputs, eos_id)} if eos_id is not None else None)
        losses.append(tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch[:, 1:]).mean().item())
    loss = sum(value * n for value, n in zip(losses, sizes)) / sum(sizes)  # a short last batch weighs its rows
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "batches": len(losses),
            "tokens": int(rows[:, 1:].numel()), "batch_losses": losses}


def shards_tokenizer(location: Path) -> str | None:
    """The tokenizer sha256 a shards (or split) directory's manifest records, beside it or above it."""
    for manifest in (location / "manifest.json", location.parent / "manifest.json"):
        if manifest.is_file():
            return json.loads(manifest.read_text()).get("tokenizer_sha256")
    return None


def check_shards_tokenizer(location: Path, meta: dict, option: str = "--shards") -> None:
    """Shards tokenized by another tokenizer than the checkpoint's give a meaningless loss: refused
    where both record theirs; `option` names them."""
    want, got = meta.get("tokenizer_sha256"), shards_tokenizer(location)
    if want and got and got != want:
        raise ToolError(f"{option} {location}: tokenized with another tokenizer (sha256 {got[:12]}) than the "
                        f"checkpoint was trained with (sha256 {want[:12]}); give shards built with the run's "
                        "tokenizer")


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--shards", help="shard directory (with SPLIT/) or a split directory")
    parser.add_argument("--tasks", nargs="+", default=[], metavar="JSONL", help="multiple-choice task files")
    parser.add_argument("--limit", type=int, default=0, help="examples per task (the first ones); 0 = all")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir for --tasks (default: the run's)")
    parser.add_argument("--split", default="val")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1:
        raise ToolError("--batches and --batch-size must be >= 1")
    if args.limit < 0:
        raise ToolError(f"--limit {args.limit}: give the number of examples per task to score, or 0 for all")
    if args.tokenizer and not args.tasks:
        raise ToolError(f"--tokenizer {args.tokenizer} encodes --tasks, which are not given (shards are already "
                        "tokenized): add --tasks or leave --tokenizer out")
    if not args.shards and not args.tasks:
        raise ToolError("give --shards (validation loss) and/or --tasks (downstream accuracy)")
    device = tool_device(args.device)
    location = split_dir(args.shards, args.split, "--split") if args.shards else None
    tag_dir = resolve_checkpoint(args.checkpoint)
    saved_meta = read_meta(tag_dir)  # checked against the shards and tasks before the model is read
    if location is not None:
        check_shards_tokenizer(location, saved_meta)
    tasks, sp = load_tasks(args, tag_dir, saved_meta) if args.tasks else ({}, None)
    model, cfg, meta = load_model(tag_dir)
    model.to(device)
    result = {"checkpoint": meta["checkpoint"], "step": meta.get("step")}
    run = run_config(tag_dir)
    bos = run_bos(run, meta)  # as the run's loader
    if location is not None:
        eos = run_document_eos(run, meta)
        rows = read_samples(location, args.batches * args.batch_size, wrap=False)  # a sample twice weighs double
        if len(rows) < args.batches * args.batch_size:
            # full batches only, as the trainer's validation (one short batch where there is no full one)
            full = max(len(rows) // args.batch_size, 1) * args.batch_size
            print(f"note: {location} holds {len(rows)} samples, fewer than --batches x --batch-size: "
                  f"{min(full, len(rows))} of them are read, in batches of {args.batch_size} (the trainer at "
                  "data-parallel size D reads whole rounds of micro_batch x D, as its start line says: "
                  "give --batches for the samples it read)", file=sys.stderr)
            rows = rows[:full]
        rows = rows if bos is None else starting_with(rows, bos)
        result.update(evaluate_rows(model, rows, args.batch_size, eos), shards=str(location),
                      document_mask=eos is not None, start_with_bos=bos is not None)
    if tasks:
        result["downstream"] = evaluate_tasks(model, tasks, sp, args.batch_size, device, bos=bos)
    if args.json:
        print(json.dumps(result))
        return 0
    if location is not None:
        print(f"loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | tokens {result['tokens']} "
              f"| step {result['step']} | {location}")
    for name, r in result.get("downstream", {}).items():
        print(f"{name}: acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | {r['examples']} examples "
              f"| step {result['step']}")
    return 0


def load_tasks(args, tag_dir: Path, meta: dict) -> tuple[dict, object]:
    """The task files (bad records counted, reported on stderr) and the run's tokenizer."""
    import sys

    from data_prep.sources import BadInputReport
    from data_prep.tokenizer import load_tokenizer
    from tools.export import find_tokenizer

    tokenizer_dir = find_tokenizer(tag_dir, args.tokenizer, meta)
    if tokenizer_dir is None:
        raise ToolError("--tasks needs the run's SentencePiece tokenizer: pass --tokenizer DIR")
    report = BadInputReport()
    missing = [p for p in args.tasks if not Path(p).is_file()]
    if missing:
        raise ToolError(f"--tasks: no such file {', '.join(missing)}")
    names = [task_name(p) for p in args.tasks]
    if len(set(names)) < len(names):
        raise ToolError(f"--tasks {' '.join(args.tasks)}: results are named by file, and two share a name; "
                        "give the files distinct names")
    error = empty_task_error(args.tasks)
    if error:
        raise ToolError(f"--tasks: {error}")
    tasks = {name: load_task(p, args.limit, report) for name, p in zip(names, args.tasks)}
    if report.count:
        print(report.summary(), file=sys.stderr)
    return tasks, load_tokenizer(tokenizer_dir)[0]


if __name__ == "__main__":
    run(main)
