"""Downstream accuracy of the demo model on a small built-in task, against the same model untrained.

    bash launch/demo.sh                       # trains runs/demo on the standard library's Python code
    python -m bench.downstream_demo [--checkpoint runs/demo] [--examples 300] [--seeds 0,1,2]

The task is made here from this repository's own Python files, which the demo never trains on:
the context is up to three lines of code and the first half of the next line, the choices are
that line's real second half and the second halves of three other lines (chance: 25%). Scored
with pretrain.downstream exactly as eval.downstream_tasks and tools.evaluate --tasks score; each
seed draws other lines and other distractors. The reference is the same architecture at its
initialisation (no training).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("data_prep", "launch", "models", "pretrain", "tools")


def make_task(path: Path, examples: int, seed: int) -> int:
    """Write the line-completion task to ``path``; returns the number of examples."""
    lines = [line for d in SOURCE_DIRS for f in sorted((REPO / d).rglob("*.py"))
             for line in f.read_text().splitlines()]
    usable = [i for i, line in enumerate(lines) if len(line.strip()) >= 24 and i >= 3]
    rng = random.Random(seed)
    picked = rng.sample(usable, min(examples, len(usable)))
    with open(path, "w") as f:
        for i in picked:
            line = lines[i]
            cut = len(line) - len(line.lstrip()) + len(line.strip()) // 2
            others = rng.sample([j for j in usable if lines[j][-8:] != line[-8:]], 3)
            choices = [line[cut:]] + [lines[j][len(lines[j]) - len(lines[j].lstrip()) + len(lines[j].strip()) // 2:]
                                      for j in others]
            order = list(range(4))
            rng.shuffle(order)
            context = "\n".join(lines[i - 3:i] + [line[:cut]])
            f.write(json.dumps({"context": context, "choices": [choices[k] for k in order],
                                "gold": order.index(0)}) + "\n")
    return len(picked)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/demo")
    p.add_argument("--examples", type=int, default=300)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    from data_prep.tokenizer import load_tokenizer
    from models.gpt import GPT
    from pretrain.checkpoint_format import read_meta, resolve_checkpoint
    from pretrain.consolidate import load_model
    from pretrain.downstream import evaluate_tasks, load_task
    from tools.export import find_tokenizer

    try:
        tag_dir = resolve_checkpoint(args.checkpoint)
    except Exception as e:  # noqa: BLE001 - any reason: tell how to get one
        print(f"error: {e}\nrun `bash launch/demo.sh` first (it trains {args.checkpoint})", file=sys.stderr)
        return 2
    tokenizer = find_tokenizer(tag_dir, None, read_meta(tag_dir))
    sp, _ = load_tokenizer(tokenizer)
    trained, cfg, meta = load_model(tag_dir)
    torch.manual_seed(0)
    untrained = GPT(cfg).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in map(int, args.seeds.split(",")):
            path = Path(tmp) / f"lines{seed}.jsonl"
            n = make_task(path, args.examples, seed)
            tasks = {"python_lines": load_task(path)}
            for name, model in (("trained", trained), ("untrained", untrained)):
                r = evaluate_tasks(model, tasks, sp, 8, torch.device("cpu"))["python_lines"]
                rows.append({"model": name, "seed": seed, "examples": n, "acc": r["acc"], "acc_norm": r["acc_norm"]})
    print(f"python line completion, 4 choices (chance 0.25), checkpoint {meta['checkpoint']} step {meta.get('step')}")
    print(f"{'model':<10} {'acc (mean [min-max])':>24} {'acc_norm (mean [min-max])':>28}   seeds {args.seeds}")
    summary = {}
    for name in ("trained", "untrained"):
        acc = [r["acc"] for r in rows if r["model"] == name]
        norm = [r["acc_norm"] for r in rows if r["model"] == name]
        summary[name] = {"acc": statistics.mean(acc), "acc_norm": statistics.mean(norm)}
        print(f"{name:<10} {statistics.mean(acc):>10.3f} [{min(acc):.3f}-{max(acc):.3f}] "
              f"{statistics.mean(norm):>14.3f} [{min(norm):.3f}-{max(norm):.3f}]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": "downstream_demo", "checkpoint": meta["checkpoint"], "step": meta.get("step"),
              "examples": args.examples, "seeds": args.seeds, "chance": 0.25,
              "provenance": provenance("bench.downstream_demo", argv), "rows": rows, "summary": summary}
    (out / "downstream_demo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'downstream_demo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
