"""Self-Guided Alignment against SFT and DPO on a synthetic two-objective task whose reward models
are exact functions, through the real post-training commands.

    python -m bench.sga_synthetic [--seeds 0 1 --sft-steps 300 --align-steps 150 --eval-prompts 200]

The task. A prompt names a topic, may carry a style word and has 2-7 filler words. Two
objectives score a response:
  length   the prompt implies a target of (fillers + 2) words without stating it:
           max(0, 1 - |words - target| / target)
  keyword  each topic has a hidden keyword: min(1, occurrences / 2)
The style word says, without naming them, how the annotators weigh the objectives: "precisely"
only length counts, "topically" only the keyword, no style word both equally. For every prompt 4
random candidates (1-12 words, 0-2 keywords) are scored; the pair is the best and the worst by the
weighted score (ties dropped) and carries the best one's scores, so what a good answer scores
depends on the prompt: what the value head has to predict. A small model is trained from scratch
with SFT on the best candidates, then DPO and SGA start from that checkpoint. On held-out prompts
each variant samples one response (T=0.6, top-p 0.9), scored against the held-out best candidate
(the reference): per objective the share of prompts where it scores higher (win) or equal (tie).
SGA is decoded three ways: with the value head's predicted scores, with the reference's true
scores (oracle) and with the training set's mean scores (fixed). The claim under test:
SGA-predicted beats DPO and SGA-fixed and comes close to the oracle. Also reported: the value
head's MSE on the held-out prompts next to the MSE of always predicting the training mean.
Writes bench/results/sga_synthetic.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
TOPICS = {"river": "water", "forest": "leaf", "city": "street", "ocean": "wave", "desert": "sand",
          "mountain": "rock", "garden": "flower", "sky": "cloud"}
FILLERS = "please kindly now then just also maybe quite really very".split()
WORDS = "the a of and to in is it that was on for with as by at from this an be".split()
OBJECTIVES = ("length", "keyword")
MODEL = ["model.vocab_size=512", "model.max_seq_len=96", "model.hidden_size=128", "model.num_heads=4",
         "model.num_layers=3", "model.ffn_hidden_size=352"]


STYLES = {"precisely": {"length": 1.0, "keyword": 0.0}, "topically": {"length": 0.0, "keyword": 1.0},
          "": {"length": 0.5, "keyword": 0.5}}


def make_prompt(rng: random.Random) -> tuple[str, str, int, dict]:
    topic, style = rng.choice(list(TOPICS)), rng.choice(list(STYLES))
    fillers = rng.randint(2, 7)
    words = ["tell", "me", "about", topic] + ([style] if style else []) + rng.choices(FILLERS, k=fillers)
    return " ".join(words), TOPICS[topic], fillers + 2, STYLES[style]


def score(response: str, keyword: str, target: int) -> dict[str, float]:
    words = response.split()
    return {"length": max(0.0, 1 - abs(len(words) - target) / target),
            "keyword": min(1.0, words.count(keyword) / 2)}


def candidate(rng: random.Random, keyword: str) -> str:
    words = rng.choices(WORDS, k=rng.randint(1, 12))
    for _ in range(rng.choice([0, 1, 2])):
        words[rng.randrange(len(words))] = keyword
    return " ".join(words)


def build_data(root: Path, seed: int, train_prompts: int, eval_prompts: int) -> dict:
    rng = random.Random(seed)
    out, seen = {}, set()
    for split, count in (("train", train_prompts), ("eval", eval_prompts)):
        rows = []
        while len(rows) < count:
            prompt, keyword, target, weights = make_prompt(rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            rated = [(c, score(c, keyword, target)) for c in (candidate(rng, keyword) for _ in range(4))]
            weighted = [sum(weights[k] * s[k] for k in OBJECTIVES) for _, s in rated]
            best, worst = weighted.index(max(weighted)), weighted.index(min(weighted))
            if weighted[best] == weighted[worst]:
                continue  # a tie: no preference
            record = {"prompt": prompt, "chosen": rated[best][0], "rejected": rated[worst][0],
                      "scores": {k: round(v, 2) for k, v in rated[best][1].items()}}
            rows.append((record, keyword, target))
        with open(root / f"{split}_pref.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r, _, _ in rows)
        with open(root / f"{split}_sft.jsonl", "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "response": r["chosen"]}) + "\n" for r, _, _ in rows)
        out[split] = rows
    return out


def train_tokenizer(root: Path, data: dict) -> Path:
    from data_prep.train_tokenizer import train_tokenizer as train

    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    text = "\n".join(f"{r['prompt']}\n{r['chosen']}\n{r['rejected']}" for r, _, _ in data["train"])
    text += "\nUser: Assistant: scores: <length_score:0.25> <keyword_score:1.0> and 0123456789.\n"
    (corpus / "text.txt").write_text(text * 3)
    out = root / "tokenizer"
    train([corpus], out, vocab_size=512, model_type="bpe", overwrite=True, num_threads=1)
    return out


def post_train(method: str, run_dir: Path, root: Path, tokenizer: Path, init: Path, steps: int, seed: int,
               extra: list[str]) -> float:
    data = "sft" if method == "sft" else "pref"
    cmd = [sys.executable, "-m", "posttrain.train", *MODEL, f"run.dir={run_dir}", f"post.method={method}",
           f"post.data={root / f'train_{data}.jsonl'}", f"post.val_data={root / f'eval_{data}.jsonl'}",
           f"data.tokenizer={tokenizer}", f"train.init_from={init}", f"train.steps={steps}",
           f"train.warmup_steps={max(1, steps // 10)}", "train.log_interval=25", f"train.eval_interval={steps}",
           f"train.save_interval={steps}", "train.micro_batch=16", f"train.seed={seed}", "train.resume=none",
           "train.weight_decay=0.0", "post.score_prefix=\nscores: ", *extra]
    from pretrain.distributed import environment_for_child

    env = dict(environment_for_child(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", DS_ACCELERATOR="cpu")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.time() - start


def init_weights(path: Path, seed: int) -> None:
    import torch

    from models.gpt import GPT
    from pretrain.config import load_config
    from pretrain.distributed import init_single_process

    init_single_process()
    torch.manual_seed(seed)
    model = GPT(load_config(None, MODEL).model)
    torch.save({"model": model.cfg.to_dict(), "state_dict": model.state_dict()}, path)


def evaluate(run_dir: Path, tokenizer: Path, data: list, mean_scores: dict, sga: bool, seed: int) -> dict:
    import torch

    from data_prep.tokenizer import load_tokenizer
    from models.generation import generate
    from posttrain.chat import ChatEncoder, ChatFormat
    from posttrain.inference import SGAModel
    from pretrain.consolidate import load_model

    sp, _ = load_tokenizer(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    results: dict[str, list] = {}
    errors = []
    if sga:
        model = SGAModel.load(run_dir, sp)
    else:
        gpt, _, _ = load_model(run_dir)
        encoder = ChatEncoder(sp, ChatFormat())
    for record, keyword, target in data:
        messages = [{"role": "user", "content": record["prompt"]}]
        reference = score(record["chosen"], keyword, target)
        if sga:
            predicted = model.predict(messages)
            errors.append(statistics.mean((predicted[k] - record["scores"][k]) ** 2 for k in OBJECTIVES))
            decodings = {"sga-predicted": predicted, "sga-oracle": record["scores"], "sga-fixed": mean_scores}
            for name, scores in decodings.items():
                ids = model.generate(messages, scores, 24, 0.6, 0.9, generator=generator)
                results.setdefault(name, []).append((score(sp.decode(ids), keyword, target), reference))
        else:
            ids = generate(gpt, encoder.prompt(messages), 24, 0.6, 0.9, eos_id=encoder.eos, generator=generator)
            ids = ids[:-1] if ids and ids[-1] == encoder.eos else ids
            results.setdefault("", []).append((score(sp.decode(ids), keyword, target), reference))
    table = {}
    for name, rows in results.items():
        entry = {}
        for k in OBJECTIVES:
            entry[f"{k}_win"] = sum(m[k] > r[k] for m, r in rows) / len(rows)
            entry[f"{k}_tie"] = sum(m[k] == r[k] for m, r in rows) / len(rows)
            entry[f"{k}_mean"] = statistics.mean(m[k] for m, _ in rows)
        table[name] = entry
    if sga:
        table["sga-predicted"]["value_mse"] = statistics.mean(errors)
        table["sga-predicted"]["mean_prediction_mse"] = statistics.mean(
            statistics.mean((mean_scores[k] - record["scores"][k]) ** 2 for k in OBJECTIVES) for record, _, _ in data)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--train-prompts", type=int, default=2000)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--align-steps", type=int, default=150)
    parser.add_argument("--work", default="runs/bench_sga")
    parser.add_argument("--out", default="bench/results/sga_synthetic.json")
    args = parser.parse_args(argv)
    work = REPO / args.work
    results = {"settings": vars(args), "seeds": {}}
    for seed in args.seeds:
        root = work / f"seed{seed}"
        root.mkdir(parents=True, exist_ok=True)
        data = build_data(root, seed, args.train_prompts, args.eval_prompts)
        tokenizer = train_tokenizer(root, data)
        init = root / "init.pt"
        init_weights(init, seed)
        mean_scores = {k: round(statistics.mean(r["scores"][k] for r, _, _ in data["train"]), 2) for k in OBJECTIVES}
        seconds = {"sft": post_train("sft", root / "sft", root, tokenizer, init, args.sft_steps, seed,
                                     ["train.lr=3e-3"])}
        sft_ckpt = root / "sft"
        for method, extra in (("dpo", ["train.lr=3e-4", "post.beta=0.1"]),
                              ("sga", ["train.lr=3e-4", "post.beta=0.1", "post.mse_weight=10",
                                       "post.value_head_width=128"])):
            seconds[method] = post_train(method, root / method, root, tokenizer, sft_ckpt, args.align_steps, seed,
                                         extra)
        table = {"sft": evaluate(root / "sft", tokenizer, data["eval"], mean_scores, False, seed)[""],
                 "dpo": evaluate(root / "dpo", tokenizer, data["eval"], mean_scores, False, seed)[""],
                 **evaluate(root / "sga", tokenizer, data["eval"], mean_scores, True, seed)}
        results["seeds"][seed] = {"table": table, "seconds": seconds, "mean_scores": mean_scores,
                                  "train_pairs": len(data["train"]), "eval_pairs": len(data["eval"])}
        print(f"seed {seed}: {len(data['train'])} train / {len(data['eval'])} eval pairs, mean scores {mean_scores}")
        partial = REPO / args.out  # each finished seed kept, should a later one fail (the summary comes last)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**results, "provenance": provenance("bench.sga_synthetic", argv)}, indent=1))
    names = list(next(iter(results["seeds"].values()))["table"])
    print(f"{'variant':<15}" + "".join(f"{c:>22}" for c in ("length win (tie)", "keyword win (tie)",
                                                              "length/keyword mean", "value MSE (predict mean)")))
    summary = {}
    for name in names:
        rows = [s["table"][name] for s in results["seeds"].values()]

        def spread(key):
            values = [r[key] for r in rows]
            return statistics.mean(values), (max(values) - min(values)) / 2

        summary[name] = {k: spread(k) for k in rows[0]}
        cells = []
        for k in OBJECTIVES:
            (win, dw), (tie, _) = summary[name][f"{k}_win"], summary[name][f"{k}_tie"]
            cells.append(f"{win:.3f}±{dw:.3f} ({tie:.2f})")
        cells.append(f"{summary[name]['length_mean'][0]:.3f}/{summary[name]['keyword_mean'][0]:.3f}")
        cells.append(f"{summary[name]['value_mse'][0]:.4f} (mean {summary[name]['mean_prediction_mse'][0]:.4f})"
                     if "value_mse" in summary[name] else "-")
        print(f"{name:<15}" + "".join(f"{c:>22}" for c in cells))
    results["summary"] = {n: {k: {"mean": m, "half_range": h} for k, (m, h) in v.items()} for n, v in summary.items()}
    results["provenance"] = provenance("bench.sga_synthetic", argv)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out} (± is half the range over seeds {args.seeds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
