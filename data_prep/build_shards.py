"""Tokenize a corpus into fixed-length training samples stored as MDS shards.

    python -m data_prep.build_shards --tokenizer data/tok --out data/shards --seq-len 2048 [--workers N]

Spread over a cluster (launch.submit_prep does these steps with Slurm job arrays)::

    python -m data_prep.build_shards --tokenizer data/tok --out OUT --seq-len 2048 --plan-only
    python -m data_prep.build_shards --out OUT --task I --tasks N      # on N machines, I = 0..N-1
    python -m data_prep.build_shards --out OUT --merge

Layout written under ``--out``::

    train/   MDS shards: one directory per part, and an index.json over all of them (column "tokens")
    val/     same, for the held-out documents
    manifest.json, plan.json, parts/

The corpus is cut into parts (:mod:`data_prep.parts`), which worker processes or Slurm tasks build
independently; a part that completed is never built again, so an interrupted build continues where
it stopped. Each document is tokenized and followed by one EOS token (no BOS: the EOS of the
previous document already marks where a new one starts). The token stream of each split of a part is
cut into samples of ``seq_len + 1`` ids, so a sample gives ``seq_len`` inputs and their next-token
targets; the tokens after the last complete sample of each part are packed together at the merge,
so only the last incomplete sample of each split is dropped (counted in the manifest).
Documents go to train or val by a seeded hash of their origin, so the split is reproducible and never
cuts a document in two. The origin is hashed with its file's path relative to the corpus source that
holds it (``--split-key relative``, the default), so a copy of the corpus elsewhere (another machine,
the folder submit_prep copies to) splits the same; ``--split-key path`` hashes the path as given
(builds planned before the option).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from data_prep import dedup
from data_prep import parts as P
from data_prep.readers import FileReadError
from data_prep.sources import (
    ALL_SUFFIXES,
    BadInputReport,
    as_sources,
    list_files,
    require_documents,
    source_relative,
)
from data_prep.tokenizer import load_tokenizer

SPLITS = ("train", "val")
TAIL_PART = "part-tails"  # samples packed from every part's leftover tokens, at the merge
# Documents are encoded in batches of about this many characters: sentencepiece's batched encode
# amortises its per-call cost, and the token arrays of a batch are built in one numpy call.
BATCH_CHARS = 1 << 20
BATCH_DOCS = 512
PIECE_CHARS = 1 << 20  # a longer document is encoded in pieces (document_pieces)
SINGLE_SPACE = re.compile(r"(?<=\S) (?=\S)")
# Settings a part's output depends on; a plan made with other values is another build.
PLAN_SETTINGS = ("sources", "text_field", "tokenizer", "tokenizer_sha256", "vocab_size", "seq_len", "val_fraction",
                 "seed", "compression", "shard_size_limit", "part_bytes", "dedup", "split_key")
SPLIT_KEYS = ("relative", "path")  # what a document's split is hashed from (see the module docstring)


# Shard compressions streaming's MDSWriter takes, with their levels ("zstd:7"); checked here, before
# --overwrite clears a build, without importing streaming (and torch) at planning time.
COMPRESSION_LEVELS = {"br": range(0, 12), "bz2": range(1, 10), "gz": range(0, 10), "snappy": None,
                      "zstd": range(1, 23)}


def check_compression(compression: str | None) -> str | None:
    """The shard compression to write with (None: none), or a ValueError naming the choices."""
    if compression in (None, "", "none"):
        return None
    known = {f"{name}:{level}" for name, levels in COMPRESSION_LEVELS.items() for level in levels or ()}
    if compression in COMPRESSION_LEVELS or compression in known:
        return compression
    choices = ", ".join(f"{n}[:{r.start}-{r.stop - 1}]" if r else n for n, r in COMPRESSION_LEVELS.items())
    raise ValueError(f"--compression {compression!r}: choose none or one of {choices}")


def assign_split(origin: str, seed: int, val_fraction: float) -> str:
    """'val' for a seeded-hash-chosen ``val_fraction`` of origins, else 'train'.

    Hashing the origin (not the position in the stream) keeps a document in the
    same split when other files are added to or removed from the corpus.
    """
    if val_fraction <= 0:
        return "train"
    h = hashlib.blake2b(f"{seed}\0{origin}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return "val" if int.from_bytes(h, "big") / 2**64 < val_fraction else "train"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def available_cpus() -> int:
    # The CPUs this process may run on: under Slurm or taskset fewer than the machine has.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def split_keys(part: P.Part, settings: dict) -> Callable[[str], str]:
    """What a document of ``part`` has its split hashed from, by its origin ("path" or "path:N"): the
    origin itself, or with split_key relative its file's path relative to its corpus source."""
    if plan_setting(settings, "split_key") != "relative":
        return lambda origin: origin
    names = {str(Path(p.path)): source_relative(p.path, settings["sources"]) for p in part.pieces}

    def key(origin: str) -> str:
        path, _, line = origin.rpartition(":")
        if line.isdigit() and path in names:
            return f"{names[path]}:{line}"
        if origin in names:
            return names[origin]
        raise ValueError(f"document {origin} is from none of this part's files")

    return key


def document_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """A document as pieces of about `size` characters, so that a long one is encoded a piece at a
    time (SentencePiece's ids of a whole 1 GiB file would take tens of GB). Each cut lies just
    before a single space between words in the piece's last quarter where there is one:
    SentencePiece starts a token there anyway, so the ids are those of the whole text (a tokenizer
    with a dummy prefix adds one token at each cut); else before a newline, else anywhere."""
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        window = end - size // 4
        spaces = [m.start() for m in SINGLE_SPACE.finditer(text, window, end)]
        cut = spaces[-1] if spaces else text.rfind("\n", window, end)
        if cut <= start:
            cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _batches(docs, split_of: Callable[[str], str]) -> Iterator[tuple[list[str], list[str], list[bool]]]:
    """Group documents into (texts, splits, ends) batches for one encode call; a long document comes
    as several texts, `ends` true at its last (which takes the EOS)."""
    texts, splits, ends, chars = [], [], [], 0
    for doc in docs:
        split = split_of(doc.origin)
        pieces = document_pieces(doc.text)
        for i, piece in enumerate(pieces):
            texts.append(piece)
            splits.append(split)
            ends.append(i == len(pieces) - 1)
            chars += len(piece)
            if chars >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                yield texts, splits, ends
                texts, splits, ends, chars = [], [], [], 0
    if texts:
        yield texts, splits, ends


# --- planning -------------------------------------------------------------------

def plan_setting(settings: dict, key: str):
    """A plan setting; a plan made before split_key existed hashed the paths as given."""
    return settings.get(key, "path" if key == "split_key" else None)


def _settings_diff(old: dict, new: dict) -> str:
    return ", ".join(f"{k}: {plan_setting(old, k)!r} there, {plan_setting(new, k)!r} now" for k in PLAN_SETTINGS
                     if plan_setting(old, k) != plan_setting(new, k))


def _clear(out_dir: Path) -> None:
    for name in (*SPLITS, P.MARKER_DIR):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in ("manifest.json", P.PLAN_FILE):
        (out_dir / name).unlink(missing_ok=True)


def plan_build(sources=None, tokenizer_dir="data/tokenizer", out_dir="data/shards", seq_len: int = 512,
               val_fraction: float = 0.01, *, compression: str | None = "zstd", shard_size_limit: int | str = "64mb",
               seed: int = 0, text_field: str = "text", part_size: int | str = "auto",
               dedup_mode: str = "none", split_key: str = "relative", overwrite: bool = False,
               dry_run: bool = False, progress: bool = False, skip_unreadable: bool = False) -> dict:
    """Check everything that can be checked cheaply, cut the corpus into parts, write ``plan.json``
    (``dry_run``: change nothing on disk).

    An existing plan with the same settings and parts is kept (its completed parts count); one with
    other settings, or finished shards, need ``overwrite`` (refused before the corpus is read).
    """
    out_dir = Path(out_dir)
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if split_key not in SPLIT_KEYS:
        raise ValueError(f"split_key {split_key!r}: choose one of {', '.join(SPLIT_KEYS)}")
    if dedup_mode not in dedup.DEDUP_MODES:
        raise ValueError(f"dedup {dedup_mode!r}: choose one of {', '.join(dedup.DEDUP_MODES)}")
    shard_size = P.parse_size(shard_size_limit)
    compression = check_compression(compression)
    finished = (out_dir / "manifest.json").is_file()
    if finished and not overwrite:
        raise FileExistsError(f"{out_dir} already contains shards (manifest.json): pass --overwrite to replace "
                              "them, or choose another --out")
    sp, tok = load_tokenizer(tokenizer_dir)
    srcs = as_sources(sources)
    skipped = Counter()
    files = list_files(srcs, skipped, progress)
    require_documents(srcs, text_field=text_field, files=files, skip_unreadable=skip_unreadable)
    total = sum(P.file_bytes(f) for f in files)
    part_bytes = P.auto_part_bytes(total) if str(part_size) == "auto" else P.parse_size(part_size)
    settings = {
        "sources": [str(s) for s in srcs], "text_field": text_field, "tokenizer": str(tokenizer_dir),
        "tokenizer_sha256": tok["sha256"], "vocab_size": sp.get_piece_size(), "eos_id": sp.eos_id(),
        "bos_id": sp.bos_id(), "tokenizer_model_type": tok.get("model_type"), "seq_len": seq_len,
        "val_fraction": val_fraction, "seed": seed,
        "compression": compression,
        "shard_size_limit": shard_size, "part_bytes": part_bytes, "dedup": dedup_mode,
    }
    if split_key != "path":  # absent: hashed by path, as plans made before the setting (their plan_id kept)
        settings["split_key"] = split_key
    old = P.read_plan(out_dir)
    if old is not None and not overwrite:
        if not (old["settings"] == settings and old.get("bytes") == total
                and P.planned_files(old) == [str(f) for f in files]):
            # Before the corpus is cut into parts, which reads every large JSON Lines file whole.
            diff = _settings_diff(old["settings"], settings) or "the corpus files changed"
            raise FileExistsError(f"{out_dir} holds an unfinished build planned differently ({diff}): pass "
                                  "--overwrite to start over, or rerun with the settings of that build")
        parts = old["parts"]  # an unfinished build resumes as it was cut, its large files not read again
    else:
        parts = [p.to_dict() for p in P.plan_parts(files, part_bytes, progress, skip_unreadable)]
    plan = {"settings": settings, "files": len(files), "bytes": total, "skipped_files": dict(skipped.most_common(20)),
            "parts": parts}
    plan["plan_id"] = P.plan_id(plan)
    plan["planned_in"] = os.getcwd()  # what relative paths in the plan are relative to (P.planned_dir)

    if overwrite:
        if not dry_run:
            _clear(out_dir)
    elif old is not None and old.get("plan_id") != plan["plan_id"]:  # e.g. other files that no reader takes
        raise FileExistsError(f"{out_dir} holds an unfinished build planned differently (the corpus files "
                              "changed): pass --overwrite to start over, or rerun with the corpus of that build")
    elif old is None:
        for split in SPLITS:
            d = out_dir / split
            if d.exists() and any(d.iterdir()):
                raise FileExistsError(f"{d} already contains files (an interrupted run?): pass --overwrite to "
                                      "replace them, or choose another --out")
    if (old is None or overwrite) and not dry_run:
        P.write_json_atomic(out_dir / P.PLAN_FILE, plan)
    return plan


# --- building one part ------------------------------------------------------------

def _tail_path(out_dir: Path, part: P.Part) -> Path:
    return Path(out_dir) / P.MARKER_DIR / f"{part.name}.tail.npz"


def build_part(out_dir: Path, plan: dict, part: P.Part, sp, on_batch: Callable[[int, int], None] | None = None,
               skip_unreadable: bool = False) -> dict:
    """Tokenize, pack and write one part; its marker, written last, is returned. A file-system error
    reading a file raises FileReadError (the part is left incomplete), or with ``skip_unreadable``
    counts the file as unreadable."""
    from streaming import MDSWriter  # pulls in torch: imported only when shards are written

    s = plan["settings"]
    dtype = token_dtype(s["vocab_size"])
    sample_len = s["seq_len"] + 1
    eos = s["eos_id"]
    marker_file = P.marker_path(out_dir, part)
    marker_file.unlink(missing_ok=True)
    report = BadInputReport(count_io_errors=skip_unreadable)
    stats = {split: {"documents": 0, "tokens": 0, "samples": 0} for split in SPLITS}
    packers = {split: SamplePacker(sample_len, dtype) for split in SPLITS}
    writers = {}
    for split in SPLITS:
        d = out_dir / split / part.name
        shutil.rmtree(d, ignore_errors=True)  # what a killed attempt left
        writers[split] = MDSWriter(out=str(d), columns={"tokens": f"ndarray:{dtype.name}"},
                                   compression=s["compression"], size_limit=s["shard_size_limit"])
    start = time.time()
    docs = P.iter_part_documents(part, s["text_field"], report)
    duplicates = [0]
    if s.get("dedup", "none") == "exact":
        docs = dedup.first_occurrences(out_dir, part, docs, duplicates)
    key = split_keys(part, s)

    def split_of(origin: str) -> str:
        return assign_split(key(origin), s["seed"], s["val_fraction"])

    for texts, splits, ends in _batches(docs, split_of):
        ids = sp.encode(texts, num_threads=1)  # one thread: the parallelism is across parts
        for x, end in zip(ids, ends):
            if end:
                x.append(eos)
        for split in SPLITS:
            chosen = [x for x, where in zip(ids, splits) if where == split]
            if not chosen:
                continue
            n = sum(map(len, chosen))
            flat = np.fromiter(itertools.chain.from_iterable(chosen), dtype=dtype, count=n)
            st = stats[split]
            st["documents"] += sum(end for end, where in zip(ends, splits) if where == split)
            st["tokens"] += n
            for sample in packers[split].add(flat):
                writers[split].write({"tokens": sample})
                st["samples"] += 1
        if on_batch is not None:
            on_batch(sum(ends), sum(map(len, ids)))
    for w in writers.values():
        w.finish()
    for split in SPLITS:
        stats[split]["dropped_tokens"] = stats[split]["tokens"] - stats[split]["samples"] * sample_len
    # The tokens after the last complete sample: the merge packs those of all parts together.
    tail = _tail_path(out_dir, part)
    tail.parent.mkdir(parents=True, exist_ok=True)
    with open(tail.with_name(tail.name + ".tmp"), "wb") as f:
        np.savez(f, **{split: packers[split].buf for split in SPLITS})
    os.replace(tail.with_name(tail.name + ".tmp"), tail)
    marker = {"plan_id": plan["plan_id"], "part": part.index, "tokenizer_sha256": s["tokenizer_sha256"],
              "seq_len": s["seq_len"], "splits": stats, "bad_inputs": report.to_dict(),
              "duplicates": duplicates[0], "seconds": round(time.time() - start, 3)}
    P.write_json_atomic(marker_file, marker)
    return marker


# --- building many parts ------------------------------------------------------------

_worker: dict = {}


def _load_plan_tokenizer(plan: dict):
    sp, tok = load_tokenizer(plan["settings"]["tokenizer"])
    if tok["sha256"] != plan["settings"]["tokenizer_sha256"]:
        raise ValueError(f"the tokenizer at {plan['settings']['tokenizer']} is not the one this build was planned "
                         "with (sha256 differs): restore it, or plan again with --overwrite")
    return sp


def _die_with(parent: int) -> None:
    """A worker ends when the build's process does (SIGKILL, the OOM killer): orphans would wait on
    their task queue forever, holding the tokenizer's memory. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def _stop_on_signal(signum, frame) -> None:
    """The build's SIGTERM handler: stop as on Ctrl-C (no new parts; the running ones finish and are kept)."""
    raise SystemExit(128 + signum)


def _init_worker(out_dir: str, plan: dict, progress_queue, skip_unreadable: bool, parent: int) -> None:
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, timeout, scancel): the build's
    # process stops it, and its workers finish their running parts; they end with it (_die_with).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with(parent)
    # Loaded once per process: the tokenizer cannot be pickled with each task.
    progress_queue.cancel_join_thread()  # progress only: a worker may exit with messages unread
    _worker.update(out_dir=Path(out_dir), plan=plan, parts=P.parts_of(plan), sp=_load_plan_tokenizer(plan),
                   queue=progress_queue, skip_unreadable=skip_unreadable)


def _in_worker(job: str, index: int):
    part, skip = _worker["parts"][index], _worker["skip_unreadable"]
    if job == "hash":
        return dedup.hash_part(_worker["out_dir"], _worker["plan"], part, skip)
    q = _worker["queue"]
    return build_part(_worker["out_dir"], _worker["plan"], part, _worker["sp"], lambda d, t: q.put((d, t)), skip)


def _run(job: str, out_dir: Path, plan: dict, todo: list[P.Part], workers: int, bar, done: Callable,
         skip_unreadable: bool) -> None:
    """``job`` (hash | build) for each part of ``todo`` in ``workers`` processes; ``done`` gets each result."""
    if workers == 1:
        sp = _load_plan_tokenizer(plan) if job == "build" else None
        for part in todo:
            done(dedup.hash_part(out_dir, plan, part, skip_unreadable) if job == "hash"
                 else build_part(out_dir, plan, part, sp, lambda d, t: bar.update(t), skip_unreadable))
        return
    _load_plan_tokenizer(plan)  # here, so that a bad tokenizer is reported as such, not as a broken pool
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    progress_queue = ctx.Queue()
    # An executor, not a Pool: a worker that dies (the OOM killer) breaks it with an error, where a
    # Pool would wait for that task forever.
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(str(out_dir), plan, progress_queue, skip_unreadable, os.getpid()))
    try:
        pending = {pool.submit(_in_worker, job, p.index): p.index for p in todo}
        while pending:
            finished, _ = wait(pending, timeout=0.02, return_when=FIRST_COMPLETED)
            for future in finished:
                index = pending.pop(future)
                try:
                    done(future.result())  # re-raises a worker's error here
                except BrokenProcessPool as e:
                    raise RuntimeError(
                        f"a worker process died while the {job} of part {index} (or another) ran, most likely killed "
                        "for memory: rerun the same command with fewer --workers (completed parts are kept)") from e
            try:
                while True:
                    bar.update(progress_queue.get(timeout=0.02)[1])
            except queue.Empty:
                pass
    except BaseException:
        print("stopping: the parts already running finish first (they are kept for the rerun) ...",
              file=sys.stderr, flush=True)
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()


def build_parts(out_dir, indices: list[int] | None = None, *, workers: int | None = None,
                progress: bool = False, log: Callable[[str], None] | None = None,
                skip_unreadable: bool = False) -> list[int]:
    """Build the parts ``indices`` (default: all) of the plan in ``out_dir`` that are not complete yet,
    in ``workers`` processes; returns the indices built. ``log`` gets one line per finished part.

    With ``dedup exact`` the parts are hashed first. A full build (``indices`` None) then builds the
    dedup index and goes on; a task's share (``indices`` given) stops after hashing while the index
    is missing: the index needs the hashes of every part (``--dedup-index``)."""
    out_dir = Path(out_dir).resolve()  # before a change of directory to the plan's
    plan = P.read_plan(out_dir)
    if plan is None:
        raise FileNotFoundError(f"no {P.PLAN_FILE} in {out_dir}: plan the build first (--plan-only, or run "
                                "build_shards without --task)")
    with P.planned_dir(plan):
        return _build_parts(out_dir, plan, indices, workers, progress, log, skip_unreadable)


def _build_parts(out_dir: Path, plan: dict, indices: list[int] | None, workers: int | None, progress: bool,
                 log: Callable[[str], None] | None, skip_unreadable: bool) -> list[int]:
    from tqdm import tqdm

    parts = P.parts_of(plan)
    chosen = [parts[i] for i in (indices if indices is not None else range(len(parts)))]
    workers = max(1, workers or available_cpus())
    if plan["settings"].get("dedup", "none") == "exact" and not dedup.index_done(out_dir, plan):
        to_hash = [p for p in chosen if not dedup.hashes_done(out_dir, p)]

        def hashed(result: dict) -> None:
            bar.update(1)
            if log:
                log(f"part {result['part']} hashed: {result['documents']} documents in {result['seconds']:.1f}s; "
                    f"{bar.n}/{len(to_hash)}")

        with tqdm(total=len(to_hash), unit="part", desc="hashing", disable=not progress) as bar:
            _run("hash", out_dir, plan, to_hash, min(workers, max(len(to_hash), 1)), bar, hashed, skip_unreadable)
        if log:
            log(f"hashed the documents of {len(to_hash)} parts ({len(chosen) - len(to_hash)} were done)")
        if indices is not None:
            if log and not to_hash:  # the parts of this task were hashed before: only the index is missing
                log(f"the dedup index is missing: run python -m data_prep.build_shards --out {out_dir} --dedup-index "
                    "(once every task has hashed its parts), then this task again to build its parts")
            return []
        counts = dedup.build_index(out_dir, plan)
        if log:
            log(f"dedup index: {counts['duplicates']} of {counts['documents']} documents are duplicates")
    todo = [p for p in chosen if P.read_marker(out_dir, p, plan) is None]
    if log and len(todo) < len(chosen):
        log(f"{len(chosen) - len(todo)} of {len(chosen)} parts already complete, skipped")
    if not todo:
        return []

    def finished(marker: dict) -> None:
        finished.count += 1
        bar.set_postfix(parts=f"{finished.count}/{len(todo)}")
        if log:
            tokens = sum(s["tokens"] for s in marker["splits"].values())
            log(f"part {marker['part']} done: {sum(s['documents'] for s in marker['splits'].values())} documents, "
                f"{tokens:,} tokens in {marker['seconds']:.1f}s ({tokens / max(marker['seconds'], 1e-9):,.0f} tok/s); "
                f"{finished.count}/{len(todo)}")
    finished.count = 0

    with tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        _run("build", out_dir, plan, todo, min(workers, len(todo)), bar, finished, skip_unreadable)
    return [p.index for p in todo]


# --- merging ---------------------------------------------------------------------

@contextmanager
def _quiet_root_logger():
    # streaming's merge_index logs a temporary folder through the root logger at WARNING.
    root = logging.getLogger()
    handler = logging.NullHandler()
    root.addHandler(handler)
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        root.removeHandler(handler)


def merge_parts(out_dir) -> dict:
    """One index per split over the parts of ``out_dir``, and ``manifest.json``; returns the manifest."""
    from streaming.base.util import merge_index

    out_dir = Path(out_dir)
    plan = P.read_plan(out_dir)
    if plan is None:
        raise FileNotFoundError(f"no {P.PLAN_FILE} in {out_dir}: nothing was planned there")
    s = plan["settings"]
    parts = P.parts_of(plan)
    markers = [P.read_marker(out_dir, p, plan) for p in parts]
    missing = [p.index for p, m in zip(parts, markers) if m is None]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise ValueError(f"{len(missing)} of {len(parts)} parts of {out_dir} are not complete (parts {shown}): "
                         "build them first (build_shards --task, or resubmit launch.submit_prep)")
    dedup_mode = s.get("dedup", "none")
    if dedup_mode == "exact" and not dedup.index_done(out_dir, plan):
        raise ValueError(f"{out_dir} deduplicates, but its dedup index is missing: run build_shards --dedup-index")
    for m in markers:
        if m["tokenizer_sha256"] != s["tokenizer_sha256"] or m["seq_len"] != s["seq_len"]:
            raise ValueError(f"part {m['part']} of {out_dir} was built with another tokenizer or seq_len than "
                             "the plan: rebuild it (delete parts/part-*.json of it)")

    from streaming import MDSWriter

    sample_len = s["seq_len"] + 1
    dtype = token_dtype(s["vocab_size"])
    stats = {split: {key: sum(m["splits"][split][key] for m in markers)
                     for key in ("documents", "tokens", "samples")} for split in SPLITS}
    # What each part left after its last complete sample, packed together in part order.
    tails = []
    for p in parts:  # read and closed one at a time: thousands of parts would exhaust the open-file limit
        with np.load(_tail_path(out_dir, p)) as tail:
            tails.append({split: tail[split] for split in SPLITS})
    for split in SPLITS:
        packer = SamplePacker(sample_len, dtype)
        rows = packer.add(np.concatenate([t[split] for t in tails]).astype(dtype))
        shutil.rmtree(out_dir / split / TAIL_PART, ignore_errors=True)
        with MDSWriter(out=str(out_dir / split / TAIL_PART), columns={"tokens": f"ndarray:{dtype.name}"},
                       compression=s["compression"], size_limit=s["shard_size_limit"]) as writer:
            for row in rows:
                writer.write({"tokens": row})
        stats[split]["samples"] += len(rows)
        stats[split]["dropped_tokens"] = len(packer.buf)
    empty = [x for x in SPLITS if stats[x]["samples"] == 0 and (x == "train" or s["val_fraction"] > 0)]
    if empty:
        counts = ", ".join(f"{x}: {stats[x]['documents']} documents / {stats[x]['tokens']} tokens" for x in SPLITS)
        raise ValueError(f"split {' and '.join(empty)} got no complete sample of {sample_len} tokens ({counts}): "
                         "use a smaller --seq-len, a larger corpus, or a larger --val-fraction (or --val-fraction 0 "
                         "for no validation split), with --overwrite; no manifest was written")
    for split in SPLITS:
        (out_dir / split / "index.json").unlink(missing_ok=True)
        if stats[split]["samples"] == 0:  # val at --val-fraction 0: no index, so training finds no val split
            continue
        with _quiet_root_logger():
            merge_index([str(out_dir / split / name / "index.json") for name in [p.name for p in parts] + [TAIL_PART]],
                        str(out_dir / split))

    report = BadInputReport()
    for m in markers:
        report.merge(m["bad_inputs"])
    dtype = token_dtype(s["vocab_size"])
    manifest = {
        "format": "mds",
        "columns": {"tokens": f"ndarray:{dtype.name}"},
        "sources": s["sources"],
        "text_field": s["text_field"],
        "tokenizer": {"dir": s["tokenizer"], "sha256": s["tokenizer_sha256"], "model_type": s["tokenizer_model_type"]},
        "tokenizer_sha256": s["tokenizer_sha256"],
        "vocab_size": s["vocab_size"],
        "token_dtype": dtype.name,
        "eos_id": s["eos_id"],
        "bos_id": s["bos_id"],
        "document_separator": "eos after each document, no bos",
        "seq_len": s["seq_len"],
        "sample_len": sample_len,
        "val_fraction": s["val_fraction"],
        "seed": s["seed"],
        "split_key": plan_setting(s, "split_key"),
        "compression": s["compression"],
        "shard_size_limit": s["shard_size_limit"],
        "parts": len(parts),
        "part_bytes": s["part_bytes"],
        "plan_id": plan["plan_id"],
        "dedup": {"method": dedup_mode, "dropped_documents": sum(m.get("duplicates", 0) for m in markers)},
        "documents": sum(stats[x]["documents"] for x in SPLITS),
        "splits": {x: {"path": x, **stats[x]} for x in SPLITS},
        "bad_inputs": report.to_dict(),
        "skipped_files": plan.get("skipped_files", {}),
    }
    P.write_json_atomic(out_dir / "manifest.json", manifest)
    return manifest


def build_shards(sources=None, tokenizer_dir="data/tokenizer", out_dir="data/shards", seq_len: int = 512,
                 val_fraction: float = 0.01, *, workers: int | None = None, overwrite: bool = False,
                 compression: str | None = "zstd", shard_size_limit: int | str = "64mb", seed: int = 0,
                 text_field: str = "text", part_size: int | str = "auto", dedup_mode: str = "none",
                 split_key: str = "relative", skip_unreadable: bool = False,
                 progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Plan, build every part on this machine and merge: ``sources`` (None = default corpus) into
    ``out_dir``; returns the manifest."""
    plan_build(sources, tokenizer_dir, out_dir, seq_len, val_fraction, compression=compression,
               shard_size_limit=shard_size_limit, seed=seed, text_field=text_field, part_size=part_size,
               dedup_mode=dedup_mode, split_key=split_key, overwrite=overwrite, progress=progress,
               skip_unreadable=skip_unreadable)
    build_parts(out_dir, workers=workers, progress=progress, log=log, skip_unreadable=skip_unreadable)
    return merge_parts(out_dir)


def _print_manifest(m: dict, out: Path, seconds: float) -> None:
    print(f"built shards from {m['documents']} documents in {seconds:.1f}s "
          f"(seq_len {m['seq_len']}, vocab {m['vocab_size']}, {m['token_dtype']}, {m['parts']} parts)")
    for split in SPLITS:
        st = m["splits"][split]
        print(f"  {split:5s} {st['documents']:>8} docs {st['tokens']:>11,} tokens {st['samples']:>8} samples "
              f"-> {out / split}")
    if m["dedup"]["method"] != "none":
        print(f"  dedup {m['dedup']['method']}: {m['dedup']['dropped_documents']} duplicate documents dropped")
    print(f"manifest: {out / 'manifest.json'}")
    report = BadInputReport()
    report.merge(m["bad_inputs"])
    print(report.summary())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.build_shards", description=__doc__.split("\n")[0])
    p.add_argument("--sources", nargs="+", default=None, metavar="PATH",
                   help="files/directories of .txt/.py/.md, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst, .json.gz, "
                        ".json.zst) or .parquet (default: the Python standard library's .py files)")
    p.add_argument("--tokenizer", help="directory written by data_prep.train_tokenizer or import_tokenizer")
    p.add_argument("--out", required=True, help="output directory (train/, val/, manifest.json)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample are seq_len + 1")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out, in [0, 1)")
    p.add_argument("--workers", type=int, default=None, help="processes building parts (default: the CPUs available)")
    p.add_argument("--overwrite", action="store_true", help="replace existing shards or an unfinished build in --out")
    p.add_argument("--compression", default="zstd", help="MDS shard compression, or 'none'")
    p.add_argument("--shard-size-limit", default="64mb", help="max shard size, e.g. 64mb")
    p.add_argument("--part-size", default="auto",
                   help="input bytes per part, e.g. 256mb (default auto: about 256 parts, 1 MiB to 256 MiB each)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val document split")
    p.add_argument("--split-key", choices=SPLIT_KEYS, default="relative",
                   help="hash each document's path relative to its corpus source (the same split wherever the "
                        "corpus lies) or as given (builds planned before this option)")
    p.add_argument("--text-field", default="text", help="JSON field or Parquet column holding the text")
    p.add_argument("--dedup", choices=dedup.DEDUP_MODES, default="none",
                   help="exact: drop documents whose text appeared before (in part order), across the whole build")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--skip-unreadable", action="store_true",
                   help="count a file the file system fails to read (EIO...) as unreadable instead of stopping")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan-only", action="store_true", help="write plan.json and stop (for a cluster build)")
    mode.add_argument("--task", type=int, default=None,
                      help="build only the parts of task TASK of --tasks (plan.json must exist in --out)")
    mode.add_argument("--merge", action="store_true", help="merge the built parts of --out into one shard set")
    mode.add_argument("--dedup-index", action="store_true",
                      help="with --dedup exact: mark first occurrences once every part is hashed")
    p.add_argument("--tasks", type=int, default=None, help="number of tasks the parts are dealt to (with --task)")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers {args.workers}: give at least 1 process (default: the CPUs available)")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.time()
    out = Path(args.out)
    try:
        if args.task is not None:
            if args.tasks is None:
                raise ValueError("--task needs --tasks (the number of tasks the parts are dealt to)")
            plan = P.read_plan(out)
            if plan is None:
                raise FileNotFoundError(f"no {P.PLAN_FILE} in {out}: plan the build first with --plan-only")
            mine = P.tasks_parts(P.parts_of(plan), args.task, args.tasks)
            log(f"task {args.task} of {args.tasks}: parts {[x.index for x in mine]}")
            build_parts(out, [x.index for x in mine], workers=args.workers, progress=False, log=log,
                        skip_unreadable=args.skip_unreadable)
            return 0
        if args.merge:
            _print_manifest(merge_parts(out), out, time.time() - start)
            return 0
        if args.dedup_index:
            plan = P.read_plan(out)
            if plan is None:
                raise FileNotFoundError(f"no {P.PLAN_FILE} in {out}: plan the build first with --plan-only")
            if plan["settings"].get("dedup") != "exact":
                raise ValueError(f"{out} was planned without --dedup exact, so there is nothing to index: plan it "
                                 "again with --dedup exact --overwrite, or build it as it is")
            counts = dedup.build_index(out, plan)
            print(f"dedup index: {counts['duplicates']} of {counts['documents']} documents are duplicates")
            return 0
        if args.tokenizer is None:
            raise ValueError("--tokenizer is required to plan a build (a directory written by "
                             "data_prep.train_tokenizer or data_prep.import_tokenizer)")
        plan = plan_build(args.sources, args.tokenizer, out, args.seq_len, args.val_fraction,
                          compression=args.compression, shard_size_limit=args.shard_size_limit, seed=args.seed,
                          text_field=args.text_field, part_size=args.part_size, dedup_mode=args.dedup,
                          split_key=args.split_key, overwrite=args.overwrite, progress=not args.no_progress,
                          skip_unreadable=args.skip_unreadable)
        if plan["skipped_files"]:
            kinds = ", ".join(f"{suffix} {n}" for suffix, n in plan["skipped_files"].items())
            print(f"skipped files no reader takes, by suffix ({kinds}); readers take {' '.join(ALL_SUFFIXES)}")
        if args.plan_only:
            print(f"planned {len(plan['parts'])} parts of {plan['files']} files ({plan['bytes']:,} bytes) "
                  f"in {out / P.PLAN_FILE}")
            return 0
        build_parts(out, workers=args.workers, progress=not args.no_progress, log=log if args.no_progress else None,
                    skip_unreadable=args.skip_unreadable)
        _print_manifest(merge_parts(out), out, time.time() - start)
    except FileReadError as e:
        plan = P.read_plan(out) or {}
        skip = ("rerun with --skip-unreadable to count it as unreadable" if plan.get("settings", {}).get("dedup")
                != "exact" else "rebuild with --overwrite --skip-unreadable (with --dedup exact the documents "
                "were hashed, and a file skipped now would no longer match)")
        print(f"error: {e}; the parts not complete are retried then. A file that fails every time: restore it, "
              f"or {skip}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # OSError: an --out that cannot be written, a full disk...
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_signal)
    sys.exit(main())
