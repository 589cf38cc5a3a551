"""Tokenize a corpus into fixed-length training samples stored as MDS shards.

    python -m data_prep.build_shards --tokenizer data/tok --out data/shards --seq-len 256

Layout written under ``--out``::

    train/   MDS shards (index.json + shard files), column "tokens"
    val/     same, for the held-out documents
    manifest.json

Each document is tokenized and followed by one EOS token (no BOS: the EOS of the
previous document already marks where a new one starts). The token stream of each
split is concatenated and cut into samples of ``seq_len + 1`` ids, so a sample gives
``seq_len`` inputs and their next-token targets; the last incomplete sample of each
split is dropped. Documents go to train or val by a seeded hash of their origin,
so the split is reproducible and never cuts a document in two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from multiprocessing import Pool
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from data_prep.sources import BadInputReport, as_sources, iter_documents, require_documents
from data_prep.tokenizer import MODEL_FILE, load_tokenizer

SPLITS = ("train", "val")
# Documents are handed to the workers in batches of about this many characters:
# big enough to amortise the inter-process round trip, small enough to keep
# every worker busy and the memory in flight low.
BATCH_CHARS = 1 << 20
BATCH_DOCS = 512


def assign_split(origin: str, seed: int, val_fraction: float) -> str:
    """'val' for a seeded-hash-chosen ``val_fraction`` of origins, else 'train'.

    Hashing the origin (not the position in the stream) keeps a document in the
    same split when other files are added to or removed from the corpus.
    """
    if val_fraction <= 0:
        return "train"
    h = hashlib.blake2b(f"{seed}\0{origin}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(h, "big") / 2**64 < val_fraction else "train"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# --- tokenization workers -------------------------------------------------------

_worker: dict = {}


def _init_worker(model_file: str, eos_id: int, dtype: str) -> None:
    # Loaded once per process: the model cannot be pickled with each task.
    _worker.update(sp=spm.SentencePieceProcessor(model_file=model_file), eos=eos_id, dtype=dtype)


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    # One thread per process; the parallelism comes from the pool.
    ids = _worker["sp"].encode(texts, num_threads=1)
    return [np.array(x + [_worker["eos"]], dtype=_worker["dtype"]) for x in ids]


def _batches(docs, seed: int, val_fraction: float) -> Iterator[tuple[list[str], list[str]]]:
    """Group documents into (splits, texts) batches for the workers."""
    splits, texts, chars = [], [], 0
    for doc in docs:
        splits.append(assign_split(doc.origin, seed, val_fraction))
        texts.append(doc.text)
        chars += len(doc.text)
        if chars >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
            yield splits, texts
            splits, texts, chars = [], [], 0
    if texts:
        yield splits, texts


def _encoded(batches: Iterable, workers: int, init_args: tuple) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """Encode batches in ``workers`` processes, yielding results in input order.

    Pool.imap would also keep the order, but its feeder thread reads the whole
    input iterator ahead, i.e. the whole corpus into memory. A bounded window of
    apply_async results gives the same ordered, parallel stream with flat memory.
    """
    if workers <= 1:
        _init_worker(*init_args)
        for splits, texts in batches:
            yield splits, _encode_batch(texts)
        return
    with Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for splits, texts in batches:
            pending.append((splits, pool.apply_async(_encode_batch, (texts,))))
            if len(pending) >= 2 * workers:
                s, r = pending.popleft()
                yield s, r.get()
        while pending:
            s, r = pending.popleft()
            yield s, r.get()


class SamplePacker:
    """Concatenates token arrays and cuts them into rows of ``sample_len`` ids."""

    def __init__(self, sample_len: int, dtype: np.dtype):
        self.sample_len = sample_len
        self.buf = np.empty(0, dtype=dtype)

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Append ``ids``; return the complete samples now available, shape (n, sample_len)."""
        self.buf = np.concatenate([self.buf, ids])
        n = len(self.buf) // self.sample_len
        samples = self.buf[: n * self.sample_len].reshape(n, self.sample_len)
        self.buf = self.buf[n * self.sample_len:].copy()
        return samples


# --- up-front checks ------------------------------------------------------------

def _check_output(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix new shards with old ones; with ``overwrite`` clear the old ones."""
    for split in SPLITS:
        d = out_dir / split
        if not d.exists() or not any(d.iterdir()):
            continue
        if not overwrite:
            what = "shards" if (d / "index.json").exists() else "files (an interrupted run?)"
            raise FileExistsError(f"{d} already contains {what}: pass --overwrite to replace them, "
                                  "or choose another --out")
        shutil.rmtree(d)
    if overwrite:
        (out_dir / "manifest.json").unlink(missing_ok=True)


def build_shards(sources=None, tokenizer_dir="data/tokenizer", out_dir="data/shards", seq_len: int = 512,
                 val_fraction: float = 0.01, *, workers: int | None = None, overwrite: bool = False,
                 compression: str | None = "zstd", shard_size_limit: int | str = "64mb", seed: int = 0,
                 text_field: str = "text", max_docs: int | None = None, progress: bool = False,
                 bad_inputs: BadInputReport | None = None) -> dict:
    """Tokenize ``sources`` (None = default corpus) into ``out_dir``; return the manifest."""
    out_dir = Path(out_dir)
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    workers = workers or os.cpu_count() or 1
    sp, tok = load_tokenizer(tokenizer_dir)
    _check_output(out_dir, overwrite)
    srcs = as_sources(sources)
    require_documents(srcs, text_field=text_field)

    vocab_size = sp.get_piece_size()
    dtype = token_dtype(vocab_size)
    column = f"ndarray:{dtype.name}"
    sample_len = seq_len + 1
    compression = None if compression in (None, "", "none") else compression
    report = bad_inputs if bad_inputs is not None else BadInputReport()
    # Imported here, after the cheap checks: importing streaming pulls in torch
    # and transformers and takes many seconds, which a usage error should not cost.
    from streaming import MDSWriter

    stats = {s: {"documents": 0, "tokens": 0, "samples": 0} for s in SPLITS}
    packers = {s: SamplePacker(sample_len, dtype) for s in SPLITS}
    writers = {s: MDSWriter(out=str(out_dir / s), columns={"tokens": column}, compression=compression,
                            size_limit=shard_size_limit) for s in SPLITS}

    docs = iter_documents(srcs, text_field=text_field, report=report, max_docs=max_docs)
    init_args = (str(Path(tokenizer_dir) / MODEL_FILE), sp.eos_id(), dtype.name)
    with tqdm(unit="doc", desc="tokenizing", disable=not progress) as bar:
        for splits, encoded in _encoded(_batches(docs, seed, val_fraction), workers, init_args):
            for split, ids in zip(splits, encoded):
                st = stats[split]
                st["documents"] += 1
                st["tokens"] += len(ids)
                for sample in packers[split].add(ids):
                    writers[split].write({"tokens": sample})
                    st["samples"] += 1
            bar.update(len(encoded))
    for w in writers.values():
        w.finish()

    empty = [s for s in SPLITS if stats[s]["samples"] == 0 and (s == "train" or val_fraction > 0)]
    if empty:
        for s in SPLITS:
            shutil.rmtree(out_dir / s, ignore_errors=True)
        counts = ", ".join(f"{s}: {stats[s]['documents']} documents / {stats[s]['tokens']} tokens" for s in SPLITS)
        raise ValueError(f"split {' and '.join(empty)} got no complete sample of {sample_len} tokens ({counts}): "
                         "use a smaller --seq-len, a larger corpus, or a larger --val-fraction "
                         "(or --val-fraction 0 for no validation split); nothing was written")

    for s in SPLITS:
        stats[s]["dropped_tokens"] = stats[s]["tokens"] - stats[s]["samples"] * sample_len
    manifest = {
        "format": "mds",
        "columns": {"tokens": column},
        "sources": [str(s) for s in srcs],
        "text_field": text_field,
        "max_docs": max_docs,
        "tokenizer": {"dir": str(tokenizer_dir), "sha256": tok["sha256"], "model_type": tok.get("model_type")},
        "tokenizer_sha256": tok["sha256"],
        "vocab_size": vocab_size,
        "token_dtype": dtype.name,
        "eos_id": sp.eos_id(),
        "bos_id": sp.bos_id(),
        "document_separator": "eos after each document, no bos",
        "seq_len": seq_len,
        "sample_len": sample_len,
        "val_fraction": val_fraction,
        "seed": seed,
        "compression": compression,
        "shard_size_limit": shard_size_limit,
        "documents": sum(stats[s]["documents"] for s in SPLITS),
        "splits": {s: {"path": s, **stats[s]} for s in SPLITS},
        "bad_inputs": report.to_dict(),
    }
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out_dir / "manifest.json")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.build_shards", description=__doc__.split("\n")[0])
    p.add_argument("--sources", nargs="+", default=None, metavar="PATH",
                   help="files/directories of .txt/.py/.md/.jsonl/.jsonl.gz "
                        "(default: the Python standard library's .py files)")
    p.add_argument("--tokenizer", required=True, help="directory written by data_prep.train_tokenizer")
    p.add_argument("--out", required=True, help="output directory (train/, val/, manifest.json)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample are seq_len + 1")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out, in [0, 1)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace existing shards in --out")
    p.add_argument("--compression", default="zstd", help="MDS shard compression, or 'none'")
    p.add_argument("--shard-size-limit", default="64mb", help="max shard size, e.g. 64mb")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val document split")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)

    start = time.time()
    report = BadInputReport()
    try:
        m = build_shards(args.sources, args.tokenizer, args.out, args.seq_len, args.val_fraction,
                         workers=args.workers, overwrite=args.overwrite, compression=args.compression,
                         shard_size_limit=args.shard_size_limit, seed=args.seed, text_field=args.text_field,
                         max_docs=args.max_docs, progress=not args.no_progress, bad_inputs=report)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"built shards from {m['documents']} documents in {time.time() - start:.1f}s "
          f"(seq_len {m['seq_len']}, vocab {m['vocab_size']}, {m['token_dtype']})")
    for s in SPLITS:
        st = m["splits"][s]
        print(f"  {s:5s} {st['documents']:>8} docs {st['tokens']:>11,} tokens {st['samples']:>8} samples "
              f"-> {Path(args.out) / s}")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
