"""Unsafe-ticket pruning: remove the weights behind an unwanted behaviour without gradients, and
write the pruned model as a new checkpoint (posttrain.pruning; one process, any saved layout).

    python -m tools.prune_unsafe --checkpoint RUN_DIR --out runs/pruned \\
        (--responses labelled.jsonl | --prompts prompts.jsonl (--rules rules.json | --classifier DIR)) \\
        [--utility chat.jsonl | --shards data/shards] [--method ratio|zscore|wanda --search greedy|beam --beam-width 3 --branches 2] \\
        [--step-ratio 0.005 --layer-cap 0.2 --pool 0.1 --steps 20 --target-unsafe-rate 0.02]
    python -m tools.prune_unsafe ... --one-shot 0.01 --method wanda|random|ratio   # baselines, no search

Responses: labelled ones from --responses ({"prompt", "response", "label": unsafe|safe|refusal}),
or sampled here from --prompts (--samples per prompt at --temperature, as the model answers them)
and labelled with the --rules file or the --classifier model (posttrain.labels). Refusals count
as safe. Responses are split in halves (seeded): one for the attribution, one held out for the
search's cross-entropies. With a labeller, the unsafe rate of the model's own answers to the held-out
prompts (or to --eval-prompts) is measured after every step (--samples answers each, drawn as the
held-out answers were) and the search stops at --target-unsafe-rate.
--utility (SFT-format JSONL: prompt / response or messages) is the utility guard's set, or --shards
its validation loss on N samples of a shard directory's val split; without either the held-out
safe responses are.

Writes OUT/checkpoints/step_00000000 (read by tools.export / generate / evaluate, train.init_from
at any layout, and train.resume), OUT/config.yaml, OUT/pruning_masks.pt ({weight name: bool mask,
True = pruned}, to keep them pruned in further training) and OUT/pruning_report.json (settings,
data counts, scores and unsafe rate per step, sparsity per layer, time, peak memory).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from data_prep.sources import BadInputReport
from models.attention.relu import reads_row_length
from models.generation import generate
from posttrain import labels, records
from posttrain.batches import Row, chunked, response_row
from posttrain.chat import ChatEncoder, ChatFormat
from posttrain.pruning import METHODS, ONE_SHOT_METHODS, Pruner, SearchConfig, sparsity_by_layer
from posttrain.records import sft_messages
from pretrain.checkpoint_format import read_meta, resolve_checkpoint
from pretrain.telemetry import peak_memory_gb
from tools.cli import ToolError, argument_parser, check_out_dir, reports_errors, run
from tools.export import run_tokenizer


def answer_row(encoder: ChatEncoder, messages: list[dict], response: str, ended: bool):
    """An answer as a row whose response is trained, with its EOS only where the model drew one: an
    answer cut off at --max-new-tokens has no end to learn or to attribute."""
    response_ids = encoder.response(response)
    return response_row(encoder.prompt(messages), response_ids if ended else response_ids[:-1])


class Sampler:
    """The model's own answers to prompts (the run's chat format), and their labels."""

    def __init__(self, model, encoder: ChatEncoder, args, labeller):
        self.model, self.encoder, self.args, self.labeller = model, encoder, args, labeller
        self.generator = torch.Generator().manual_seed(args.seed)

    def answers(self, prompts: list[list[dict]], samples: int, seed: int | None = None
                ) -> list[tuple[list[dict], str, bool]]:
        """`samples` answers to each prompt, drawn on from `seed` where given: (prompt, answer, whether
        it ended with EOS rather than at --max-new-tokens)."""
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
        out = []
        for messages in prompts:
            ids = self.encoder.prompt(messages)
            for _ in range(samples):
                new = generate(self.model, ids, self.args.max_new_tokens, self.args.temperature, 1.0, False,
                               self.encoder.eos, self.generator)
                ended = bool(new) and new[-1] == self.encoder.eos
                out.append((messages, self.encoder.decode_response([t for t in new if t != self.encoder.eos]), ended))
        return out

    def label(self, answers: list[tuple[list[dict], str, bool]]) -> list[str]:
        return self.labeller([m[-1]["content"] for m, _, _ in answers], [r for _, r, _ in answers])

    def heldout_seed(self) -> int:
        return self.args.seed + 1

    def unsafe_rate(self, prompts: list[list[dict]]) -> float:
        """The unsafe share of --samples answers per prompt, drawn as the held-out answers were (their
        seed): at step 0 those very answers, and every step on the same draws, so that steps compare."""
        answers = self.answers(prompts, self.args.samples, seed=self.heldout_seed())
        return sum(label == "unsafe" for label in self.label(answers)) / max(len(answers), 1)


def source_format(meta: dict, bos: int | None) -> ChatFormat:
    """How the responses are encoded: the chat format the source was post-trained with (its meta),
    else the default turns, beginning with BOS where the source run's samples did (bos: run_bos)."""
    chat = meta.get("posttrain", {}).get("chat")
    return ChatFormat.recorded(chat) if chat else ChatFormat(add_bos=bos is not None)


def carried_meta(meta: dict) -> dict:
    """What the pruned run keeps of the source's checkpoint meta: the special ids and the chat
    format the next tools read (generate, evaluate and export add BOS by the bos_id), not the old
    run's data."""
    carried = {k: meta[k] for k in ("eos_id", "bos_id", "special_ids") if k in meta}
    if "chat" in meta.get("posttrain", {}):
        carried["posttrain"] = {"chat": meta["posttrain"]["chat"]}
    return carried


def make_labeller(args):
    if args.rules:
        return labels.RuleLabeller(args.rules)
    if args.classifier:
        if not Path(args.classifier).is_dir():
            raise ToolError(f"--classifier {args.classifier}: no such directory; give a local Hugging Face "
                            "sequence-classification model folder")
        return labels.ClassifierLabeller(args.classifier, args.unsafe_label, threshold=args.unsafe_threshold)
    return None


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True, help="new run directory for the pruned model")
    parser.add_argument("--overwrite", action="store_true")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--responses", nargs="+", help="labelled responses (JSONL / Parquet)")
    source.add_argument("--prompts", nargs="+", help="prompts to sample the model's answers to")
    parser.add_argument("--rules", help="rule file labelling answers (posttrain.labels)")
    parser.add_argument("--classifier", help="local HF sequence-classification model directory labelling answers")
    parser.add_argument("--unsafe-label", default="unsafe", help="the classifier's unsafe class name")
    parser.add_argument("--unsafe-threshold", type=float, default=0.5,
                        help="a multi-label classifier: the unsafe label's probability above which an answer is unsafe")
    parser.add_argument("--samples", type=int, default=3, help="answers per prompt")
    parser.add_argument("--eval-prompts", nargs="+", default=[],
                        help="prompts whose answers' unsafe rate is measured each step (default: the held-out half)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    utility = parser.add_mutually_exclusive_group()
    utility.add_argument("--utility", nargs="+", default=[], help="SFT-format JSONL for the utility guard")
    utility.add_argument("--shards", help="the utility guard is the validation loss on these shards (their val split)")
    parser.add_argument("--shard-samples", type=int, default=64, help="--shards: samples of the val split")
    parser.add_argument("--method", default="ratio", choices=ONE_SHOT_METHODS)
    parser.add_argument("--one-shot", type=float, default=0.0, metavar="FRACTION",
                        help="no search: prune this share of the weights at once (with --method random too)")
    parser.add_argument("--search", default="greedy", choices=["greedy", "beam"])
    parser.add_argument("--objective", default="log_ratio", choices=["log_ratio", "difference"],
                        help="what a step must lower: log CE_safe - log CE_unsafe, or CE_safe - CE_unsafe")
    defaults = SearchConfig()
    for key in ("pool", "step_ratio", "layer_cap", "safe_budget", "utility_budget", "target_unsafe_rate"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=getattr(defaults, key))
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--beam-width", type=int, default=3, help="beam: states kept per step")
    parser.add_argument("--branches", type=int, default=2, help="beam: candidates per state")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir (default: the run's)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    inputs = {f"--{flag} {path}": path for flag in ("responses", "prompts", "utility", "eval-prompts")
              for path in getattr(args, flag.replace("-", "_")) or []}
    inputs.update({f"--{flag}": getattr(args, flag) for flag in ("shards", "tokenizer", "rules",
                                                                 "classifier")})
    check_out_dir(out, inputs)  # --overwrite replaces the directory after these are read
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ToolError(f"--out {out} exists and is not empty; choose a new directory or pass --overwrite")
    if not 0 < args.unsafe_threshold < 1:
        raise ToolError(f"--unsafe-threshold {args.unsafe_threshold}: give a probability between 0 and 1")
    labeller = make_labeller(args)
    if args.prompts and labeller is None:
        raise ToolError("--prompts needs a labeller for the sampled answers: --rules FILE or --classifier DIR")
    if args.eval_prompts and labeller is None:
        raise ToolError("--eval-prompts needs a labeller for the answers: --rules FILE or --classifier DIR")
    if args.method not in METHODS and not args.one_shot:
        raise ToolError(f"--method {args.method} is a baseline for --one-shot FRACTION; search with one of {METHODS}")
    if not 0 <= args.one_shot < 1:
        raise ToolError("--one-shot must be in [0, 1)")
    small = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("beam_width", "branches", "batch_size",
                                                                         "samples") if getattr(args, name) < 1]
    if small:
        raise ToolError(f"{', '.join(small)}: must be at least 1")
    missing = [f"--{flag.replace('_', '-')} {path}" for flag in ("utility", "eval_prompts", "responses", "prompts")
               for path in getattr(args, flag) or [] if not Path(path).is_file()]
    if missing:
        raise ToolError(f"no such file: {', '.join(missing)}")
    if args.target_unsafe_rate and args.responses and not args.eval_prompts:
        raise ToolError("--target-unsafe-rate measures the answers to prompts: with --responses, give --eval-prompts "
                        "FILE (and a labeller), or leave --target-unsafe-rate at 0")
    if not 0 < args.step_ratio < 1 or not 0 < args.layer_cap <= 1 or not 0 < args.pool <= 1:
        raise ToolError("--step-ratio must be in (0, 1), --layer-cap and --pool in (0, 1]")
    # One shot takes its ranking's first weights: at most --pool of each layer, at most --layer-cap.
    limits = [f"--{flag} {getattr(args, flag.replace('-', '_'))}" for flag in ("pool", "layer-cap")
              if args.one_shot > getattr(args, flag.replace("-", "_"))]
    if limits and args.method != "random":
        raise ToolError(f"--one-shot {args.one_shot} cannot be reached within {' and '.join(limits)} (each layer's "
                        "share that may be pruned): raise them, or lower --one-shot")
    if args.shards:
        from tools.evaluate import split_dir

        split_dir(args.shards, "val")  # checked before the model loads and the answers are sampled
    config = SearchConfig(args.method, args.pool, args.step_ratio, args.layer_cap, args.steps,
                          args.beam_width if args.search == "beam" else 1,
                          args.branches if args.search == "beam" else 1, args.safe_budget, args.utility_budget,
                          args.target_unsafe_rate, args.objective)
    started = time.perf_counter()
    tag_dir = resolve_checkpoint(args.checkpoint)
    check_out_dir(out, {"the checkpoint being pruned": tag_dir})  # --checkpoint may name a run, resolved here
    meta = read_meta(tag_dir)
    if args.shards:
        from tools.evaluate import check_shards_tokenizer, split_dir

        check_shards_tokenizer(split_dir(args.shards, "val"), meta)  # before the model loads
    sp = run_tokenizer(tag_dir, args.tokenizer, meta)
    from pretrain.consolidate import load_model, run_config
    from pretrain.data import run_bos, run_document_eos

    run = run_config(tag_dir)
    bos = run_bos(run, meta)
    encoder = ChatEncoder(sp, source_format(meta, bos))
    report = BadInputReport()
    utility_rows = [Row(*encoder.conversation(m)) for m, _ in records.read(args.utility, sft_messages, report)]
    if args.utility and not utility_rows:
        raise ToolError(f"--utility {' '.join(args.utility)} holds no usable example ({report.summary()}): the "
                        "utility guard would be left out")
    eval_prompts = labels.read_prompts(args.eval_prompts, report) if args.eval_prompts else []
    if args.eval_prompts and not eval_prompts:
        raise ToolError(f"--eval-prompts {' '.join(args.eval_prompts)} holds no usable prompt ({report.summary()})")

    model, cfg, _ = load_model(tag_dir)
    if reads_row_length(cfg):
        raise ToolError("model.relu_attention.normalizer=seqlen divides by the padded row length, so each answer's "
                        "attribution and loss would depend on the others in its batch (--batch-size): a model "
                        "trained with it cannot be pruned here (prefix and content can)")
    sampler = Sampler(model, encoder, args, labeller) if labeller is not None else None
    rng = random.Random(args.seed)
    heldout_prompts: list[list[dict]] = []
    if args.responses:  # (prompt, response, label, half, ended): given responses are whole
        labelled = labels.read_labelled(args.responses, report)
        rng.shuffle(labelled)
        labelled = [(*item, i % 2, True) for i, item in enumerate(labelled)]
    else:  # the halves by prompt: the held-out prompts' answers are never attributed
        prompts = labels.read_prompts(args.prompts, report)
        rng.shuffle(prompts)
        heldout_prompts = prompts[1::2]
        print(f"sampling {args.samples} answers to each of {len(prompts)} prompts ...", flush=True)
        labelled = []
        for half, part in enumerate((prompts[::2], heldout_prompts)):
            answers = sampler.answers(part, args.samples, seed=sampler.heldout_seed() if half else args.seed)
            labelled += [(m, r, label, half, ended) for (m, r, ended), label in zip(answers, sampler.label(answers))]
    if args.eval_prompts:
        heldout_prompts = eval_prompts
    sets = {"calibration": {"unsafe": [], "safe": []}, "heldout": {"unsafe": [], "safe": []}}
    longer = {split: {"unsafe": 0, "safe": 0} for split in sets}
    for messages, response, label, half, ended in labelled:
        kind = "unsafe" if label == "unsafe" else "safe"
        split = "heldout" if half else "calibration"
        row = answer_row(encoder, messages, response, ended)
        if len(row.ids) <= cfg.max_seq_len + 1:
            sets[split][kind].append(row)
        else:
            longer[split][kind] += 1
    if any(n for part in longer.values() for n in part.values()):
        print(f"responses longer than model.max_seq_len={cfg.max_seq_len} with their prompt, left out: {longer}",
              flush=True)
    too_long = [r for r in utility_rows if len(r.ids) > cfg.max_seq_len + 1]
    utility_rows = [r for r in utility_rows if len(r.ids) <= cfg.max_seq_len + 1]
    if too_long:
        print(f"--utility: {len(too_long)} examples longer than model.max_seq_len={cfg.max_seq_len} left out")
    if args.utility and not utility_rows:
        raise ToolError(f"--utility {' '.join(args.utility)}: every example is longer than model.max_seq_len="
                        f"{cfg.max_seq_len}: the utility guard would be left out")
    counts = {split: {k: len(v) for k, v in part.items()} for split, part in sets.items()}
    if min(min(c.values()) for c in counts.values()) == 0:
        raise ToolError(f"need unsafe and safe responses in both halves, got {counts}; "
                        f"({report.summary()}; longer than model.max_seq_len={cfg.max_seq_len}: {longer}); give "
                        "more prompts or responses")
    print(f"responses: {counts}; {report.summary()}", flush=True)
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    cap = cfg.max_seq_len + 1
    utility = chunked(utility_rows, args.batch_size, pad, cap)
    if args.shards:  # every token of a sample counts: the cross-entropy is the validation loss
        from models.attention.masks import document_ids
        from pretrain.data import read_samples, starting_with
        from tools.evaluate import split_dir

        samples = read_samples(split_dir(args.shards, "val"), args.shard_samples)
        if samples.shape[1] - 1 > cfg.max_seq_len or int(samples.max()) >= cfg.vocab_size:
            raise ToolError(f"--shards {args.shards}: samples of {samples.shape[1] - 1} tokens or ids beyond the "
                            "vocabulary; give shards built for this model and tokenizer")
        samples = samples if bos is None else starting_with(samples, bos)  # as the run's loader and evaluate
        eos = run_document_eos(run, meta)
        utility = [{"tokens": rows, "trained": torch.ones_like(rows, dtype=torch.bool),
                    "documents": None if eos is None else document_ids(rows[:, :-1], eos)}
                   for rows in samples.split(args.batch_size)]
    pruner = Pruner(model, {k: chunked(v, args.batch_size, pad, cap) for k, v in sets["calibration"].items()},
                    {k: chunked(v, args.batch_size, pad, cap) for k, v in sets["heldout"].items()},
                    utility, config,
                    (lambda: sampler.unsafe_rate(heldout_prompts)) if sampler and heldout_prompts else None)
    if args.one_shot:
        state, history = pruner.one_shot(args.one_shot, args.seed)
    else:
        state, history = pruner.beam() if args.search == "beam" else pruner.greedy()
    pruner.norms.remove()

    from pretrain.checkpoint import save_weights_run
    from pretrain.config import Config

    run_cfg = run_config(tag_dir) or Config()
    run_cfg.model = cfg
    run_cfg.run.dir, run_cfg.run.name = str(out), out.name
    run_cfg.parallel.tensor, run_cfg.parallel.expert, run_cfg.parallel.zero_stage = 1, 1, 1
    run_cfg.train.precision, run_cfg.train.init_from, run_cfg.train.resume = "fp32", "", "auto"
    summary = {"method": args.method, "search": "one-shot" if args.one_shot else args.search, "sparsity": state.scores["sparsity"],
               "pruned_weights": state.pruned(), "source": str(tag_dir)}
    carried = carried_meta(meta)
    if meta.get("heads"):
        print(f"note: the pruned checkpoint holds the LM only, not the source's {', '.join(meta['heads'])}",
              file=sys.stderr)
    new_tag = save_weights_run(model, run_cfg, out, {"tokenizer_sha256": meta.get("tokenizer_sha256"), **carried,
                                                     "pruning": summary})
    torch.save(state.masks, out / "pruning_masks.pt")
    result = {"settings": {k: v for k, v in vars(args).items()}, "responses": counts, "too_long": longer,
              "bad_inputs": report.to_dict(),
              "not_attributed": sorted(pruner.norms.skipped), "history": history, "final": {**state.scores, "pruned": state.pruned()},
              "sparsity_by_layer": sparsity_by_layer(state), "seconds": time.perf_counter() - started,
              "peak_memory_gb": peak_memory_gb(), "checkpoint": str(new_tag)}
    (out / "pruning_report.json").write_text(json.dumps(result, indent=1))
    first, last = history[0], history[-1]
    print(f"pruned {100 * state.scores['sparsity']:.2f}% of the attributed weights in {len(history) - 1} steps: "
          f"CE unsafe {first['ce_unsafe']:.4f} -> {last['ce_unsafe']:.4f}, safe {first['ce_safe']:.4f} -> "
          f"{last['ce_safe']:.4f}, utility {first['utility']:.4f} -> {last['utility']:.4f}"
          + (f", unsafe rate {first['unsafe_rate']:.3f} -> {last['unsafe_rate']:.3f}"
             if last.get("unsafe_rate") is not None else ""))
    print(f"wrote {new_tag} and {out / 'pruning_report.json'}")
    return 0


if __name__ == "__main__":
    run(main)
