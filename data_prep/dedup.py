"""Exact deduplication of documents across a whole build (``build_shards --dedup exact``).

Three steps, so that parts can still be built anywhere and in any order:

1. every part writes the 128-bit blake2b hash of each of its documents' text, in reading order
   (``parts/part-NNNNN.hashes.npy``);
2. one step reads all hashes in part order and marks the first occurrence of each text as kept
   (``parts/part-NNNNN.keep.npy``, ``parts/dedup.json`` written last);
3. building a part skips the documents its mask drops.

Memory of step 2: about 48 bytes per document of the corpus (a billion documents: 48 GB).
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data_prep import parts as P
from data_prep.readers import Document
from data_prep.sources import BadInputReport

INDEX_FILE = "dedup.json"
DEDUP_MODES = ("none", "exact")


def text_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _path(out_dir: Path, part: P.Part, kind: str) -> Path:
    return Path(out_dir) / P.MARKER_DIR / f"{part.name}.{kind}.npy"


def _save(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    P.write_atomic(path, buffer.getvalue())


def hashes_done(out_dir: Path, part: P.Part) -> bool:
    return _path(out_dir, part, "hashes").is_file()


def hash_part(out_dir: Path, plan: dict, part: P.Part, skip_unreadable: bool = False) -> dict:
    """Step 1 for one part; returns its index, document count and seconds. Bad records are counted
    when it is built."""
    start = time.time()
    report = BadInputReport(count_io_errors=skip_unreadable)
    digests = b"".join(text_hash(doc.text) for doc in
                       P.iter_part_documents(part, plan["settings"]["text_field"], report))
    _save(_path(out_dir, part, "hashes"), np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2))
    return {"part": part.index, "documents": len(digests) // 16, "seconds": time.time() - start}


def index_done(out_dir: Path, plan: dict) -> bool:
    marker = P.read_json(Path(out_dir) / P.MARKER_DIR / INDEX_FILE)
    return marker is not None and marker.get("plan_id") == plan["plan_id"]


def first_of_each(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each (hi, lo) pair. A stable sort by (hi, lo) puts equal
    pairs together in their original order, so each run's first member is the one to keep."""
    order = np.lexsort((lo, hi))
    keep = np.zeros(len(order), dtype=bool)
    if len(order):
        sorted_hi, sorted_lo = hi[order], lo[order]
        keep[order[0]] = True
        keep[order[1:]] = (sorted_hi[1:] != sorted_hi[:-1]) | (sorted_lo[1:] != sorted_lo[:-1])
    return keep


def build_index(out_dir: Path, plan: dict) -> dict:
    """Step 2: the keep masks of all parts (first occurrence in part order wins); returns the counts."""
    parts = P.parts_of(plan)
    missing = [p.index for p in parts if not hashes_done(out_dir, p)]
    if missing:
        raise ValueError(f"{len(missing)} parts of {out_dir} have no document hashes yet (parts "
                         f"{', '.join(map(str, missing[:20]))}): hash them first (build_shards --task)")
    hashes = [np.load(_path(out_dir, p, "hashes")) for p in parts]
    lengths = [len(h) for h in hashes]
    everything = np.concatenate(hashes) if hashes else np.empty((0, 2), np.uint64)
    del hashes
    keep = first_of_each(everything[:, 0], everything[:, 1])
    offset = 0
    for part, n in zip(parts, lengths):
        _save(_path(out_dir, part, "keep"), np.packbits(keep[offset: offset + n]))
        offset += n
    counts = {"plan_id": plan["plan_id"], "documents": int(len(keep)), "duplicates": int((~keep).sum())}
    P.write_json_atomic(Path(out_dir) / P.MARKER_DIR / INDEX_FILE, counts)
    return counts


def first_occurrences(out_dir: Path, part: P.Part, docs: Iterable[Document], dropped: list[int]
                      ) -> Iterator[Document]:
    """Step 3: the documents of ``part`` its keep mask keeps, counting the others in dropped[0]. Each
    document must be the one hashed at its place: a file that changed, or failed to read in one pass
    and not in the other, would shift every later document against the mask."""
    hashes = np.load(_path(out_dir, part, "hashes"))
    keep = np.unpackbits(np.load(_path(out_dir, part, "keep")), count=len(hashes)).astype(bool)
    stale = (f"{part.name} of {out_dir} reads differently than when it was hashed for --dedup exact "
             "(a file changed, or one could not be read in one of the passes)")
    fix = "if the files are back as they were, rerun the part, else rebuild with --overwrite"
    count = 0
    for count, doc in enumerate(docs, start=1):
        if count > len(hashes) or text_hash(doc.text) != hashes[count - 1].tobytes():
            raise ValueError(f"{stale}: document {count} ({doc.origin}) is not the one hashed; {fix}")
        if keep[count - 1]:
            yield doc
        else:
            dropped[0] += 1
    if count != len(hashes):
        raise ValueError(f"{stale}: {count} documents read, {len(hashes)} hashed; {fix}")
