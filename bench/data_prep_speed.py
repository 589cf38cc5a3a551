"""Shard building throughput against sentencepiece's own batched encoding of the same documents.

    python -m bench.data_prep_speed [--files 16] [--scales 1,4] [--repeats 3] [--out bench/results]

The corpus is web-like JSON Lines made from the standard library's text (documents of 200-2000
characters, split over ``--files`` files; scale k repeats it k times with distinct origins), and a
4096-piece BPE tokenizer trained on it. Per scale, in one run:

* ``sp x1`` / ``sp x2``: ``SentencePieceProcessor.encode(batch, num_threads=1 or 2)`` over all
  documents already in memory, batches of 512 (the tokenizer alone, nothing read or written);
* ``build x1`` / ``build x2``: ``data_prep.build_shards`` with 1 and 2 workers, seq_len 2048, zstd,
  each in a fresh process, timed from the call to the manifest (plan, read, encode, pack, write,
  merge; the interpreter start and imports are not counted), with the peak resident memory of the
  process and of its largest worker.

Tokens/s are medians over ``--repeats`` runs, with min and max. Goals: build x1 >= 0.7 x sp x1,
build x2 >= 1.7 x build x1, and peak memory that does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import provenance

BATCH = 512


def make_corpus(root: Path, files: int, scale: int) -> int:
    """Web-like JSONL documents from the stdlib's text; returns the document count."""
    from data_prep.sources import iter_documents

    rng = random.Random(0)
    docs = []
    for d in iter_documents(None):
        i = 0
        while i < len(d.text):
            n = rng.randrange(200, 2000)
            docs.append(d.text[i:i + n])
            i += n
    root.mkdir(parents=True, exist_ok=True)
    handles = [open(root / f"part{i:03d}.jsonl", "w") for i in range(files)]
    count = 0
    for copy in range(scale):
        for j, text in enumerate(docs):
            handles[(copy * len(docs) + j) * files // (scale * len(docs))].write(json.dumps({"text": text}) + "\n")
            count += 1
    for h in handles:
        h.close()
    return count


def sp_encode_speed(corpus: Path, tokenizer: Path, threads: int) -> float:
    import sentencepiece as spm

    from data_prep.sources import iter_documents

    texts = [d.text for d in iter_documents([corpus])]
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer / "tokenizer.model"))
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), BATCH):
        tokens += sum(map(len, sp.encode(texts[i:i + BATCH], num_threads=threads)))
    return tokens / (time.perf_counter() - start)


def build_in_child(corpus: str, tokenizer: str, out: str, workers: int) -> None:
    """Runs in a fresh process: prints {tokens_per_s, seconds, rss_mb, worker_rss_mb} as JSON."""
    import streaming  # noqa: F401  (imported before the clock starts)

    from data_prep.build_shards import build_shards

    start = time.perf_counter()
    m = build_shards([corpus], tokenizer, out, seq_len=2048, val_fraction=0.01, workers=workers, overwrite=True)
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in m["splits"].values())
    print(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "parts": m["parts"],
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def build_speed(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    res = subprocess.run([sys.executable, "-m", "bench.data_prep_speed", "--child", str(corpus), str(tokenizer),
                          str(out), str(workers)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return json.loads(res.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--scales", default="1,4", help="corpus sizes, as multiples of the base corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        build_in_child(args.child[0], args.child[1], args.child[2], int(args.child[3]))
        return 0

    from data_prep.train_tokenizer import train_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = tmp / "tok"
        for scale in map(int, args.scales.split(",")):
            corpus = tmp / f"corpus{scale}"
            docs = make_corpus(corpus, args.files, scale)
            if not tok.exists():
                train_tokenizer([corpus], tok, vocab_size=4096, num_threads=2)
            runs: dict[str, list] = {"sp x1": [], "sp x2": [], "build x1": [], "build x2": []}
            builds: dict[str, list] = {"build x1": [], "build x2": []}
            for _ in range(args.repeats):
                runs["sp x1"].append(sp_encode_speed(corpus, tok, 1))
                runs["sp x2"].append(sp_encode_speed(corpus, tok, 2))
                for w in (1, 2):
                    b = build_speed(corpus, tok, tmp / "out", w)
                    builds[f"build x{w}"].append(b)
                    runs[f"build x{w}"].append(b["tokens_per_s"])
            med = {k: statistics.median(v) for k, v in runs.items()}
            rows.append({
                "scale": scale, "documents": docs, "bytes": sum(f.stat().st_size for f in corpus.iterdir()),
                "tokens": builds["build x1"][0]["tokens"], "parts": builds["build x1"][0]["parts"],
                "tokens_per_s": {k: spread(v) for k, v in runs.items()},
                "build_x1_over_sp_x1": med["build x1"] / med["sp x1"],
                "build_x2_over_build_x1": med["build x2"] / med["build x1"],
                "build_x2_over_sp_x2": med["build x2"] / med["sp x2"],
                "peak_rss_mb": {k: max(b["rss_mb"] for b in v) for k, v in builds.items()},
                "peak_worker_rss_mb": max(b["worker_rss_mb"] for b in builds["build x2"]),
            })

    print(f"{'scale':>5} {'tokens':>11} {'parts':>5} | {'sp x1':>7} {'sp x2':>7} {'build x1':>8} {'build x2':>8}"
          f" (M tok/s, median of {args.repeats}) | {'x1/sp':>6} {'x2/x1':>6} {'x2/sp2':>6} | rss x1, x2, worker MB")
    for r in rows:
        t = {k: v["median"] / 1e6 for k, v in r["tokens_per_s"].items()}
        print(f"{r['scale']:>5} {r['tokens']:>11,} {r['parts']:>5} | {t['sp x1']:7.2f} {t['sp x2']:7.2f} "
              f"{t['build x1']:8.2f} {t['build x2']:8.2f}{'':>25} | {r['build_x1_over_sp_x1']:6.2f} "
              f"{r['build_x2_over_build_x1']:6.2f} {r['build_x2_over_sp_x2']:6.2f} | "
              f"{r['peak_rss_mb']['build x1']:.0f}, {r['peak_rss_mb']['build x2']:.0f}, {r['peak_worker_rss_mb']:.0f}")
    result = {"bench": "data_prep_speed", "machine": platform.machine(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "files": args.files, "repeats": args.repeats,
              "batch": BATCH, "seq_len": 2048, "provenance": provenance("bench.data_prep_speed", argv),
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_prep_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'data_prep_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
