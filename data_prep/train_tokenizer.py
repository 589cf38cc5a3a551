"""Train a SentencePiece tokenizer on a corpus.

    python -m data_prep.train_tokenizer --out data/tok --vocab-size 4096

Writes ``OUT/tokenizer.model`` and ``OUT/tokenizer.json`` (ids, vocab size and the
model's sha256, so shards built with it can be traced back to it).

The tokenizer learns from a uniform sample of the corpus's documents (reservoir sampling over every
file, seeded, at most ``--sample-docs`` documents of at most ``--max-doc-chars`` characters each, so
memory is bounded by their product whatever the corpus size), shuffled, of which the first
``--max-sentences`` lines go to SentencePiece. ``OUT/tokenizer_sample.txt`` lists the origins of the
sampled documents; tokenizer.json records how many were seen and sampled.

Choices that matter downstream:

* byte_fallback: any character outside the vocabulary becomes its UTF-8 bytes, so
  there is never an ``<unk>`` in practice and decoding is lossless.
* identity normalisation, no whitespace squashing and no dummy prefix: decoding a
  token stream gives back exactly the text that was encoded, also across the
  document boundaries of a packed sample.
* fixed special ids unk=0 bos=1 eos=2 pad=3, which the training code relies on.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import random
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import sentencepiece as spm

from data_prep.readers import FileReadError
from data_prep.sources import BadInputReport, Document, as_sources, iter_documents, list_files, require_documents
from data_prep.tokenizer import META_FILE, MODEL_FILE, SPECIAL_IDS, install, sha256_file

# SentencePiece silently drops training sentences longer than this many bytes.
MAX_SENTENCE_BYTES = 4192
SAMPLE_FILE = "tokenizer_sample.txt"


def reservoir_sample(docs: Iterable[Document], size: int, seed: int, max_doc_chars: int,
                     stats: dict) -> list[Document]:
    """A uniform sample of ``size`` documents of the stream (Algorithm R), each cut to ``max_doc_chars``,
    in a seeded random order. Holds ``size`` documents at most, however long the stream."""
    rng = random.Random(seed)
    sample: list[Document] = []
    for i, doc in enumerate(docs):
        stats["documents_seen"] = i + 1
        slot = i if i < size else rng.randrange(i + 1)
        if slot < size:
            kept = Document(doc.text[:max_doc_chars], doc.origin)
            if slot == len(sample):
                sample.append(kept)
            else:
                sample[slot] = kept
    rng.shuffle(sample)
    return sample


def _training_lines(docs, max_sentences: int, stats: dict) -> Iterator[str]:
    """Lines of the documents, the unit SentencePiece learns from.

    Whole documents would be cut by MAX_SENTENCE_BYTES; lines keep the memory use
    and the per-sentence limit in check. ``max_sentences`` bounds the total training time.
    """
    for doc in docs:
        stats["documents"] += 1
        for line in doc.text.splitlines():
            if not line.strip():
                continue
            if len(line.encode("utf-8")) > MAX_SENTENCE_BYTES:
                line = line.encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", "ignore")
            if stats["sentences"] >= max_sentences:
                return
            stats["sentences"] += 1
            stats["chars"] += len(line)
            yield line


def _train(lines, model_writer, vocab_size: int, model_type: str, num_threads: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model_writer,
        vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, **SPECIAL_IDS,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        # Code is full of indentation: let runs of spaces become single tokens.
        allow_whitespace_only_pieces=True,
        # Rare characters are better served by byte fallback than by a vocab slot.
        character_coverage=0.9995,
        # A small corpus may not support the requested size; take what it gives
        # instead of failing (the real size is recorded in tokenizer.json).
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES, num_threads=num_threads, minloglevel=2,
    )


def check_writable(out_dir: Path) -> None:
    """--out can hold the tokenizer: created if missing, and a file can be written there."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot write there ({e.strerror or e}); choose a directory you can "
                         "write to") from None


def train_tokenizer(sources=None, out_dir="data/tokenizer", vocab_size: int = 4096,
                    model_type: str = "bpe", *, max_sentences: int = 300_000, sample_docs: int = 20_000,
                    max_doc_chars: int = 50_000, seed: int = 0, overwrite: bool = False,
                    text_field: str = "text", num_threads: int = 2,
                    bad_inputs: BadInputReport | None = None, progress: bool = False) -> dict:
    """Train a tokenizer on ``sources`` (None = default corpus) and return its metadata."""
    out_dir = Path(out_dir)
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size <= 256 + len(SPECIAL_IDS):
        raise ValueError(f"vocab_size {vocab_size} is too small: the 256 byte-fallback pieces "
                         f"and {len(SPECIAL_IDS)} special tokens alone need {256 + len(SPECIAL_IDS)}")
    if sample_docs < 1 or max_doc_chars < 1 or max_sentences < 1:
        raise ValueError("sample_docs, max_doc_chars and max_sentences must be at least 1")
    if (out_dir / MODEL_FILE).exists() and not overwrite:
        raise FileExistsError(f"tokenizer already exists at {out_dir}: pass --overwrite to replace it")
    check_writable(out_dir)  # before the pass over the corpus and the training, not after
    report = bad_inputs if bad_inputs is not None else BadInputReport()
    srcs = as_sources(sources)
    files = list_files(srcs, progress=progress)
    require_documents(srcs, text_field=text_field, files=files, skip_unreadable=report.count_io_errors)

    stats = {"documents_seen": 0, "documents": 0, "sentences": 0, "chars": 0}
    from tqdm import tqdm

    # The sample is drawn from every document: a pass over the whole corpus.
    docs = tqdm(iter_documents(srcs, text_field=text_field, report=report, files=files), unit="doc", unit_scale=True,
                desc="sampling documents", disable=not progress)
    sample = reservoir_sample(docs, sample_docs, seed, max_doc_chars, stats)
    lines = _training_lines(sample, max_sentences, stats)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        _train(lines, model, vocab_size, model_type, num_threads)
    except RuntimeError as e:
        # SentencePiece reports e.g. "not enough sentences" this way; say which corpus.
        raise ValueError(f"SentencePiece training failed on {', '.join(map(str, srcs))} "
                         f"({stats['sentences']} lines read): {e}") from e

    out_dir.mkdir(parents=True, exist_ok=True)
    # The model under a temporary name until install() moves it in with its record.
    tmp = out_dir / (MODEL_FILE + ".tmp")
    tmp.write_bytes(model.getvalue())
    # surrogateescape: file names that are not UTF-8 come back as they were listed
    origins = "".join(d.origin + "\n" for d in sample).encode("utf-8", "surrogateescape")
    sp = spm.SentencePieceProcessor(model_file=str(tmp))
    meta = {
        "vocab_size": sp.get_piece_size(),
        "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "pad_id": sp.pad_id(),
        "model_type": model_type,
        "sha256": sha256_file(tmp),
        "byte_fallback": True,
        "normalization": "identity",
        "add_dummy_prefix": False,
        "requested_vocab_size": vocab_size,
        "sources": [str(s) for s in srcs],
        "training": {**stats, "max_sentences": max_sentences, "max_doc_chars": max_doc_chars, "seed": seed,
                     "sample": {"method": "reservoir", "size": sample_docs, "documents": len(sample),
                                "origins": SAMPLE_FILE,
                                "origins_sha256": hashlib.sha256(origins).hexdigest()}},
        "bad_inputs": report.to_dict(),
    }
    install(out_dir, tmp, meta, {SAMPLE_FILE: origins})
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.train_tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("--sources", nargs="+", default=None, metavar="PATH",
                   help="files/directories of .txt/.py/.md, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst, .json.gz, "
                        ".json.zst) or .parquet (default: the Python standard library's .py files)")
    p.add_argument("--out", required=True, help="output directory for tokenizer.model/.json")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--sample-docs", type=int, default=20_000,
                   help="documents sampled uniformly from the whole corpus to train on")
    p.add_argument("--max-doc-chars", type=int, default=50_000,
                   help="keep at most this many characters of each sampled document (memory: sample-docs x this)")
    p.add_argument("--max-sentences", type=int, default=300_000,
                   help="cap on training lines fed to SentencePiece from the shuffled sample (bounds time)")
    p.add_argument("--text-field", default="text", help="JSON field or Parquet column holding the text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)")
    p.add_argument("--skip-unreadable", action="store_true",
                   help="count a file the file system fails to read (EIO...) as unreadable instead of stopping")
    args = p.parse_args(argv)

    start = time.time()
    report = BadInputReport(count_io_errors=args.skip_unreadable)
    try:
        meta = train_tokenizer(args.sources, args.out, args.vocab_size, args.model_type,
                               max_sentences=args.max_sentences, sample_docs=args.sample_docs,
                               max_doc_chars=args.max_doc_chars,
                               seed=args.seed, overwrite=args.overwrite, text_field=args.text_field,
                               bad_inputs=report, progress=not args.no_progress)
    except FileReadError as e:
        print(f"error: {e}. A file that fails every time: restore it, or rerun with --skip-unreadable to count it "
              "as unreadable", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = meta["training"]
    print(f"trained {meta['model_type']} tokenizer, vocab {meta['vocab_size']}, on {t['documents']} documents "
          f"sampled from {t['documents_seen']} ({t['sentences']} lines, {t['chars']:,} chars) "
          f"in {time.time() - start:.1f}s")
    print(f"wrote {Path(args.out) / MODEL_FILE} and {Path(args.out) / META_FILE} (sha256 {meta['sha256'][:12]})")
    if meta["vocab_size"] < args.vocab_size:  # SentencePiece stops where the corpus has no more pieces
        print(f"note: the corpus gave {meta['vocab_size']} tokens, fewer than --vocab-size {args.vocab_size}: "
              f"set model.vocab_size={meta['vocab_size']} (or more), or train on more text")
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
