"""Exact deduplication of documents across a whole build (``build_shards --dedup exact``).

Three steps, so that parts can still be built anywhere and in any order:

1. every part writes the 128-bit blake2b hash of each of its documents' text, in reading order
   (``parts/part-NNNNN.hashes.npy``);
2. one step reads all hashes in part order and marks the first occurrence of each text as kept
   (``parts/part-NNNNN.keep.npy``, ``parts/dedup.json`` written last);
3. building a part skips the documents its mask drops.

Memory of step 2: 16 bytes per document of the corpus (a billion documents: 16 GB).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from data_prep import parts as P
from data_prep.sources import BadInputReport

INDEX_FILE = "dedup.json"
DEDUP_MODES = ("none", "exact")


def text_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _path(out_dir: Path, part: P.Part, kind: str) -> Path:
    return Path(out_dir) / P.MARKER_DIR / f"{part.name}.{kind}.npy"


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def hashes_done(out_dir: Path, part: P.Part) -> bool:
    return _path(out_dir, part, "hashes").is_file()


def hash_part(out_dir: Path, plan: dict, part: P.Part) -> int:
    """Step 1 for one part; returns its document count. Bad records are counted when it is built."""
    digests = b"".join(text_hash(doc.text) for doc in
                       P.iter_part_documents(part, plan["settings"]["text_field"], BadInputReport()))
    _save(_path(out_dir, part, "hashes"), np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2))
    return len(digests) // 16


def index_done(out_dir: Path, plan: dict) -> bool:
    marker = P.read_json(Path(out_dir) / P.MARKER_DIR / INDEX_FILE)
    return marker is not None and marker.get("plan_id") == plan["plan_id"]


def build_index(out_dir: Path, plan: dict) -> dict:
    """Step 2: the keep masks of all parts (first occurrence in part order wins); returns the counts."""
    parts = P.parts_of(plan)
    missing = [p.index for p in parts if not hashes_done(out_dir, p)]
    if missing:
        raise ValueError(f"{len(missing)} parts of {out_dir} have no document hashes yet (parts "
                         f"{', '.join(map(str, missing[:20]))}): hash them first (build_shards --task)")
    hashes = [np.load(_path(out_dir, p, "hashes")) for p in parts]
    everything = np.concatenate(hashes) if hashes else np.empty((0, 2), np.uint64)
    _, first = np.unique(everything.view([("hi", np.uint64), ("lo", np.uint64)]).ravel(), return_index=True)
    keep = np.zeros(len(everything), dtype=bool)
    keep[first] = True
    offset = 0
    for part, h in zip(parts, hashes):
        _save(_path(out_dir, part, "keep"), np.packbits(keep[offset: offset + len(h)]))
        offset += len(h)
    counts = {"plan_id": plan["plan_id"], "documents": int(len(keep)), "duplicates": int((~keep).sum())}
    P.write_json_atomic(Path(out_dir) / P.MARKER_DIR / INDEX_FILE, counts)
    return counts


def keep_mask(out_dir: Path, part: P.Part) -> np.ndarray:
    """Step 3: True for the documents of ``part`` to keep, in reading order."""
    count = len(np.load(_path(out_dir, part, "hashes")))
    return np.unpackbits(np.load(_path(out_dir, part, "keep")), count=count).astype(bool)
