"""Training step time of LISA models against their source, eager and compiled, at several lengths.

    python -m bench.lisa_train_step [--layouts-from bench/results/lisa_decode.json] [--hidden 1024] \
        [--seqs 512 1024 2048] [--repeats 5] [--modes eager compiled] [--chain-scores rebuild keep]

The layouts (which layers share attention, K/V sharing, alignment width) are the source and the
conversions that bench.lisa_decode measured, read from its results file; they are timed at
--hidden wide with random weights (speed does not depend on them) and the 1B hybrid config's head
width, rank and alignment group (bench.lisa_decode.wide_config). One step is the forward and
backward of one sequence with every parameter trained (continued pretraining of a converted model),
`eager`, and `compiled` with every block under torch.compile as train.compile runs it (compiled once
per length, with static shapes). With `--chain-scores keep` each layout with a LISA chain is also
timed with model.lisa.keep_chain_scores (rows "... kept"). The models take turns within every
repeat and each ratio to the source is taken per repeat (median and range), so the machine's drift
hits all of them alike.
On a GPU when one is present (float32, as the models are built), else on the CPU.
Writes bench/results/lisa_train_step.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from bench.lisa_decode import check_wide_hidden, wide_config
from bench.provenance import provenance
from bench.trainer_runs import REPO
from models.attention.lisa import chained_lisa_layers


def layouts_from(results: Path, align_hidden: int | None) -> list[tuple[str, object]]:
    """(name, ModelConfig) of the source and every conversion in a bench.lisa_decode results file:
    configs/tiny_dense.yaml at 8 layers with its source overrides, each row's attention kinds."""
    from pretrain.config import load_config

    if not results.is_file():
        raise SystemExit(f"--layouts-from {results}: no such file; run `python -m bench.lisa_decode` first "
                         "or point at its results (bench/results/lisa_decode.json)")
    report = json.loads(results.read_text())
    meta = report["meta"]
    hidden = meta["align_hidden"] if align_hidden is None else align_hidden
    layouts = []
    for row in report["rows"]:
        overrides = ["model.num_layers=8", *meta["source_overrides"], f"model.attention={row['attention']}"]
        if hidden is not None:
            overrides.append(f"model.lisa.align_hidden={hidden}")
        layouts.append((row["model"], load_config(REPO / "configs/tiny_dense.yaml", overrides).model))
    return layouts


def with_chain_scores(layouts: list[tuple[str, object]], modes: list[str]) -> list[tuple[str, object]]:
    """The layouts as they are (rebuild) and, for keep, a copy of each with a LISA chain that keeps
    the chain's scores ("<name> kept"); the source stays first."""
    out = [(name, cfg) for name, cfg in layouts if "rebuild" in modes or name == layouts[0][0]]
    for name, cfg in layouts[1:] if "keep" in modes else []:
        if chained_lisa_layers(cfg.attention_kinds()):
            kept = copy.deepcopy(cfg)
            kept.lisa.keep_chain_scores = True
            out.append((f"{name} kept", kept))
    return out


def step_seconds(model, tokens: torch.Tensor) -> float:
    """Seconds of one forward and backward of the next-token loss on tokens [batch, seq + 1]; the
    gradients are dropped after."""
    t0 = time.perf_counter()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def time_in_turn(models: dict, seq: int, vocab: int, repeats: int, device: torch.device
                 ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds of `repeats` steps of every model, taking turns, and of each model's first step (a
    round before them: warm-up, and compilation)."""
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    first = {name: step_seconds(model, tokens) for name, model in models.items()}
    samples = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            samples[name].append(step_seconds(model, tokens))
    return samples, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts-from", default="bench/results/lisa_decode.json",
                        help="a bench.lisa_decode results file: its source and conversions are timed")
    parser.add_argument("--align-hidden", type=int, default=None,
                        help="the LISA alignment FFN width (default: the one the results file converted with)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--chain-scores", nargs="+", choices=["rebuild", "keep"], default=["rebuild", "keep"],
                        help="how LISA chains read the scores before them: "
                             "model.lisa.keep_chain_scores false / true")
    parser.add_argument("--out", default="bench/results/lisa_train_step.json")
    args = parser.parse_args(argv)
    check_wide_hidden(parser, "--hidden", args.hidden)
    from models.gpt import GPT
    from pretrain.distributed import init_single_process

    layouts = with_chain_scores(layouts_from(REPO / args.layouts_from, args.align_hidden), args.chain_scores)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_single_process()
    models, configs = {}, {}
    for name, cfg in layouts:
        configs[name] = wide_config(cfg, args.hidden, max(args.seqs))
        torch.manual_seed(0)
        models[name] = GPT(configs[name]).to(device).train()
        print(f"built {name}: {configs[name].attention} ({sum(p.numel() for p in models[name].parameters()) / 1e6:.1f}M "
              "parameters)", flush=True)
    source = layouts[0][0]
    vocab = configs[source].vocab_size
    results = {name: {"attention": configs[name].attention, "align_hidden": configs[name].lisa.align_hidden,
                      "keep_chain_scores": configs[name].lisa.keep_chain_scores} for name in models}
    meta = {"layouts_from": args.layouts_from, "hidden": args.hidden, "seqs": args.seqs, "repeats": args.repeats,
            "modes": args.modes, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), **provenance("bench.lisa_train_step", argv), "batch": 1}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        if mode == "compiled":
            for model in models.values():
                model.compile_blocks()
        for seq in args.seqs:
            torch.compiler.reset()  # static shapes per length, as a run of one length compiles them
            samples, first = time_in_turn(models, seq, vocab, args.repeats, device)
            for name, seconds in samples.items():
                ratios = [t / s for s, t in zip(samples[source], seconds)]
                results[name][f"{mode}@{seq}"] = {
                    "median_s": statistics.median(seconds), "x_source": statistics.median(ratios),
                    "x_source_range": [min(ratios), max(ratios)], "seconds": seconds, "first_step_s": first[name]}
            out.write_text(json.dumps({"meta": meta, "models": results}, indent=1))  # kept if a later length fails
            print(f"timed {mode} steps at sequence {seq}", flush=True)

    keys = [f"{mode}@{seq}" for mode in args.modes for seq in args.seqs]
    print(f"\ntraining step time x source at hidden {args.hidden} (median [range] of {args.repeats} repeats; "
          "source seconds in the first column)")
    print(f"{'':<16}{'source s':>10}" + "".join(f"{name:>20}" for name in list(models)[1:]))
    for key in keys:
        cells = "".join(f"{results[name][key]['x_source']:>8.2f} [{results[name][key]['x_source_range'][0]:.2f}-"
                        f"{results[name][key]['x_source_range'][1]:.2f}]" for name in list(models)[1:])
        print(f"{key:<16}{results[source][key]['median_s']:>10.2f}{cells}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
