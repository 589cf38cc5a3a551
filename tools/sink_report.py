"""Attention-sink report of a checkpoint (the metrics of models.sinks).

    python -m tools.sink_report --checkpoint RUN_DIR/checkpoints/step_00001000 --out DIR

loads the checkpoint into one process (any saved layout, via pretrain.consolidate), runs a
validation batch (T = 64 tokens, as in Gu et al.) with attention capture, prints the
per-layer table and writes sink_report.json and a layer x head heatmap of alpha_1 to DIR.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from models.attention.masks import document_ids
from models.sinks import DEFAULT_EPS, DEFAULT_SEQ, SinkStats, measure
from pretrain.checkpoint_format import resolve_checkpoint
from pretrain.config import Config
from pretrain.consolidate import load_model, run_config
from pretrain.data import load_val_batches, run_bos, run_document_eos, starting_with
from tools.cli import ToolError, argument_parser, reports_errors, run
from tools.evaluate import check_shards_tokenizer, shards_tokenizer
from tools.export import run_path_places


def sample_tokens(ckpt: Path, cfg, meta: dict, batch: int, seq: int, shards: str | None
                  ) -> tuple[torch.Tensor, str]:
    """Validation tokens [batch, seq] from the shards (the run's own by default), else random
    ordinary tokens, beginning with BOS where the run's samples did."""
    full = run_config(ckpt)
    if full is not None or shards:
        full = full or Config()
        if shards:
            full.data.shards, full.data.mix = shards, []  # --shards replaces the run's mixture too
        else:  # the run's own, relative to where it was launched perhaps
            def located(path: str) -> str:
                """The first place holding shards of the checkpoint's tokenizer, else the first there."""
                found = [] if "://" in path else [p for p in run_path_places(Path(path), ckpt) if p.is_dir()]
                own = [p for p in found if shards_tokenizer(p) == meta.get("tokenizer_sha256")]
                return str((own or found)[0]) if found else path

            full.data.shards = located(full.data.shards)
            full.data.mix = [dataclasses.replace(source, shards=located(source.shards)) for source in full.data.mix]
        for source in full.data.sources:
            if "://" not in source.shards:
                check_shards_tokenizer(Path(source.shards), meta, "--shards" if shards else "the run's data.shards")
        full.train.micro_batch, full.train.eval_batches = batch, 1
        full.eval.val_sets = []  # the probe is the first training source's first batch
        where = Path(full.data.shards)
        try:
            batches, problem = load_val_batches(full, apart=True), "no samples in their val/ split"
        except Exception as err:  # noqa: BLE001 - fall back to random tokens, but say so
            batches, problem = [], f"cannot read them: {err}"
        if not batches and "://" not in full.data.shards and not where.is_dir():
            problem = f"no such directory ({where.resolve()}; a relative path is read from the current directory)"
        if batches:
            return batches[0][:, :seq], f"validation shards {full.data.shards}"
        if shards:  # asked for: never replaced by random tokens
            raise ToolError(f"--shards {shards}: {problem}; give a shards directory with a validation split")
        print(f"warning: validation shards {full.data.shards}: {problem}; using random tokens (--shards DIR "
              "probes real text)", file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    special = {i for i in (meta.get("bos_id"), meta.get("eos_id"), *meta.get("special_ids", {}).values())
               if isinstance(i, int) and 0 <= i < cfg.vocab_size}
    ordinary = torch.tensor([i for i in range(cfg.vocab_size) if i not in special])
    tokens = ordinary[torch.randint(0, len(ordinary), (batch, seq), generator=gen)]
    bos = run_bos(full, meta)
    return (tokens, "random tokens") if bos is None else (starting_with(tokens, bos), "random tokens after BOS")


def table(stats: SinkStats, kinds: list[str], eps: float) -> str:
    lines = [f"{'layer':>5} {'kind':<13} {'alpha1 mean':>11} {'alpha1 max':>10} {'Sink1 rate':>10} "
             f"{'row total':>9} {'share1':>7}"]
    rates = stats.layer_sink_rate(eps)
    for i, layer in enumerate(stats.layers):
        lines.append(f"{layer:>5} {kinds[layer]:<13} {stats.alpha1[i].mean():>11.4f} {stats.alpha1[i].max():>10.4f} "
                     f"{rates[i]:>10.3f} {stats.row_total[i].mean():>9.4f} {stats.share1[i].mean():>7.4f}")
    lines.append(f"Sink_1^{eps} over all layers and heads: {100 * stats.sink_rate(eps):.2f}%")
    lines.append(f"alpha1 of a head attending uniformly over the same queries: {stats.uniform1:.4f}")
    if stats.uniform1 > eps / 2:
        lines.append(f"warning: that is above eps/2 = {eps / 2:g} (short documents or --seq): Sink_1 counts heads "
                     "that attend evenly; compare alpha1 with it, or probe longer documents")
    return "\n".join(lines)


def heatmap(stats: SinkStats, kinds: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = stats.alpha1.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * heads + 2), max(3.0, 0.35 * layers + 1.5)))
    im = ax.imshow(stats.alpha1.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_yticks(range(layers), [f"{layer} {kinds[layer]}" for layer in stats.layers])
    ax.set_xticks(range(heads))
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="alpha_1 (weight on first token)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@reports_errors()
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True, help="RUN_DIR (newest complete) or RUN_DIR/checkpoints/TAG")
    parser.add_argument("--out", required=True, help="directory for sink_report.json and sink_heatmap.png")
    parser.add_argument("--shards", help="shards directory with val/ (default: the run's data.shards)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ)
    parser.add_argument("--eps", type=float, default=DEFAULT_EPS)
    parser.add_argument("--overwrite", action="store_true", help="replace the report files in --out")
    args = parser.parse_args(argv)
    if args.seq < 2 or args.batch < 1:
        raise ToolError(f"--seq {args.seq} --batch {args.batch}: give --seq of at least 2 (Gu et al. use 64) and "
                        "--batch of at least 1")
    if not 0 < args.eps < 1:
        raise ToolError(f"--eps {args.eps}: give a threshold between 0 and 1 (Gu et al. use 0.3)")
    out = Path(args.out)  # checked before the model is read
    if out.exists() and not out.is_dir():
        raise ToolError(f"--out {out} is a file; give a directory (sink_report.json and sink_heatmap.png go "
                        "in it)")
    written = [out / name for name in ("sink_report.json", "sink_heatmap.png") if (out / name).exists()]
    if written and not args.overwrite:
        raise ToolError(f"--out {out} holds a report already ({', '.join(p.name for p in written)}); choose "
                        "another directory or pass --overwrite")
    if args.shards and "://" not in args.shards and not (Path(args.shards) / "val" / "index.json").is_file():
        raise ToolError(f"--shards {args.shards}: no val/index.json there; give a shards directory with a "
                        "validation split (data_prep.build_shards with --val-fraction above 0)")
    ckpt = resolve_checkpoint(args.checkpoint)
    model, cfg, meta = load_model(ckpt)
    if args.seq > cfg.max_seq_len:
        print(f"note: --seq {args.seq} is longer than the model's model.max_seq_len={cfg.max_seq_len}: measuring "
              f"{cfg.max_seq_len} tokens per sequence")
    tokens, source = sample_tokens(ckpt, cfg, meta, args.batch, min(args.seq, cfg.max_seq_len), args.shards)
    full = run_config(ckpt)
    eos = run_document_eos(full, meta)
    stats = measure(model, tokens, document_ids(tokens, eos), row_length=cfg.max_seq_len)  # as training attended
    if stats is None:
        raise ToolError(f"no attention layer of this model ({cfg.attention}) exposes its weights; "
                        "nothing to report")
    kinds = cfg.attention_kinds()
    out.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint {ckpt} (step {meta.get('step')}), {tokens.shape[0]} x {tokens.shape[1]} tokens from {source}")
    print(table(stats, kinds, args.eps))
    report = {"checkpoint": str(ckpt), "step": meta.get("step"), "tokens": source, "eps": args.eps,
              "seq": tokens.shape[1], "sink_rate": stats.sink_rate(args.eps), "kinds": kinds,
              "alpha1": stats.alpha1.tolist(), "row_total": stats.row_total.tolist(),
              "share1": stats.share1.tolist(), "alpha1_uniform": stats.uniform1}
    (out / "sink_report.json").write_text(json.dumps(report, indent=1))
    heatmap(stats, kinds, out / "sink_heatmap.png", f"alpha_1, step {meta.get('step')}")
    print(f"wrote {out / 'sink_report.json'} and {out / 'sink_heatmap.png'}")
    return 0


if __name__ == "__main__":
    run(main)
