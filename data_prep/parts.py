"""A corpus cut into deterministic parts, the unit of work of a shard build.

A part is a run of whole files in listing order, closed once it holds ``part_bytes`` of input, a
run of row groups of one large Parquet file, or a range of lines of one large uncompressed JSON Lines
file (cut at line starts; planning reads such a file once to count its lines, so that each range
knows its first line number and its documents keep their "path:line" origin, whatever the part
size). The cut depends on the files alone (their order and sizes), never on how many processes or
Slurm tasks build it, so every way of building a corpus gives the same parts and therefore the same
samples.

On disk, under the output directory of a build::

    plan.json                   settings and the list of parts (written once, before any part)
    train/part-NNNNN/, val/...  the MDS shards of each part
    parts/part-NNNNN.json       a part's counts; written last, so it marks the part complete
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from tqdm import tqdm

from data_prep.readers import (PARQUET_SUFFIXES, Document, FileReadError, has_suffix, parquet_row_groups,
                               read_file)

PLAN_FILE = "plan.json"
MARKER_DIR = "parts"
MIN_AUTO_PART_BYTES = 1 << 20
MAX_AUTO_PART_BYTES = 256 << 20
JSONL_SCAN_BYTES = 16 << 20  # read at a time when counting a large JSON Lines file's lines


@dataclass(frozen=True)
class Piece:
    path: str
    row_groups: tuple[int, ...] | None = None  # None: the whole file
    # A .jsonl's bytes [start, end), the line number at start and the file's size when planned.
    lines: tuple[int, int, int, int] | None = None
    # A Parquet file's size and row-group count when planned (row_groups index into that layout).
    layout: tuple[int, int] | None = None


@dataclass(frozen=True)
class Part:
    index: int
    pieces: tuple[Piece, ...]
    bytes: int

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"

    def to_dict(self) -> dict:
        def piece(p: Piece) -> list:
            row = [p.path, list(p.row_groups) if p.row_groups is not None else None]
            if p.layout is not None:
                return row + [list(p.lines) if p.lines is not None else None, list(p.layout)]
            return row + ([list(p.lines)] if p.lines is not None else [])

        return {"pieces": [piece(p) for p in self.pieces], "bytes": self.bytes}

    @classmethod
    def from_dict(cls, index: int, d: dict) -> "Part":
        def piece(path, groups, lines=None, layout=None) -> Piece:
            return Piece(path, tuple(groups) if groups is not None else None, tuple(lines) if lines else None,
                         tuple(layout) if layout else None)

        return cls(index, tuple(piece(*p) for p in d["pieces"]), d["bytes"])


def parse_size(text: int | str) -> int:
    """Bytes of ``64mb``, ``1gb``, ``512kb`` or a plain number."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower()
    for unit, factor in (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40), ("b", 1)):
        if s.endswith(unit):
            s, mult = s[: -len(unit)], factor
            break
    else:
        mult = 1
    try:
        value = float(s) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # inf and nan parse as floats
        raise ValueError(f"size {text!r}: use a number of bytes or e.g. 64mb, 1gb")
    if value < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return int(value)


def auto_part_bytes(total_bytes: int) -> int:
    """About 256 parts for a corpus, each between 1 MiB and 256 MiB of input."""
    return max(MIN_AUTO_PART_BYTES, min(MAX_AUTO_PART_BYTES, total_bytes // 256))


def file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # broken link or unreadable: the reader reports it when the part is built


def jsonl_line_ranges(path: Path, part_bytes: int, progress: bool = False) -> list[tuple[int, int, int, int]]:
    """(start, end, first line number, file size) of consecutive byte ranges of about ``part_bytes``
    each, cut after a newline: the whole file in one read pass (about a minute per 100 GB; with
    progress, a bar on stderr)."""
    ranges, start, first_line, newlines, offset = [], 0, 1, 0, 0
    target = part_bytes
    with open(path, "rb") as f, tqdm(total=file_bytes(path), unit="B", unit_scale=True, leave=False,
                                     desc=f"planning: lines of {path.name}", disable=not progress) as bar:
        while chunk := f.read(JSONL_SCAN_BYTES):
            bar.update(len(chunk))
            searched = 0
            while offset + len(chunk) > target:
                cut = chunk.find(b"\n", max(searched, target - offset))
                if cut < 0:
                    break  # the line goes on into the next chunk
                newlines += chunk.count(b"\n", searched, cut + 1)
                ranges.append((start, offset + cut + 1, first_line))
                start, first_line, searched = offset + cut + 1, newlines + 1, cut + 1
                target = start + part_bytes
            newlines += chunk.count(b"\n", searched)
            offset += len(chunk)
    if start < offset:
        ranges.append((start, offset, first_line))
    return [(*r, offset) for r in ranges]


def plan_parts(files: Sequence[Path], part_bytes: int, progress: bool = False,
               skip_unreadable: bool = False) -> list[Part]:
    """Cut ``files`` (in order) into parts of about ``part_bytes`` of input each (progress: a bar
    while a large .jsonl file's lines are counted)."""
    parts: list[Part] = []
    pieces: list[Piece] = []
    size = 0

    def close() -> None:
        nonlocal pieces, size
        if pieces:
            parts.append(Part(len(parts), tuple(pieces), size))
            pieces, size = [], 0

    for path in files:
        n = file_bytes(path)
        if has_suffix(path.name, PARQUET_SUFFIXES) and n > part_bytes:
            groups = parquet_row_groups(path)
            if len(groups) > 1:
                close()
                run: list[int] = []
                run_bytes = 0
                layout = (n, len(groups))
                for i, (_, group_bytes) in enumerate(groups):
                    run.append(i)
                    run_bytes += group_bytes
                    if run_bytes >= part_bytes:
                        parts.append(Part(len(parts), (Piece(str(path), tuple(run), layout=layout),), run_bytes))
                        run, run_bytes = [], 0
                if run:
                    parts.append(Part(len(parts), (Piece(str(path), tuple(run), layout=layout),), run_bytes))
                continue
        if path.name.endswith(".jsonl") and n > part_bytes:  # compressed streams cannot be entered midway
            try:
                ranges = jsonl_line_ranges(path, part_bytes, progress)
            except (PermissionError, FileNotFoundError):
                ranges = []  # the reader reports the file when its part is built
            except OSError as err:  # the file system failing: counted when asked, as the reader does
                if not skip_unreadable:
                    raise FileReadError(f"could not read {path} to plan its parts: {err.strerror or err} (errno "
                                        f"{err.errno}), a failure of the file system, not of the file") from err
                ranges = []
            if len(ranges) > 1:
                close()
                parts += [Part(len(parts) + i, (Piece(str(path), lines=r),), r[1] - r[0])
                          for i, r in enumerate(ranges)]
                continue
        pieces.append(Piece(str(path)))
        size += n
        if size >= part_bytes:
            close()
    close()
    return parts


def planned_files(plan: dict) -> list[str]:
    """The files a plan's parts read, in order, each once."""
    return list(dict.fromkeys(piece.path for part in parts_of(plan) for piece in part.pieces))


def iter_part_documents(part: Part, text_field: str, report) -> Iterator[Document]:
    for piece in part.pieces:
        yield from read_file(Path(piece.path), text_field, report, piece.row_groups, piece.lines, piece.layout)


# --- the parts of a build on disk -------------------------------------------------

def plan_id(plan: dict) -> str:
    """Fingerprint of a plan's settings and parts: a marker from another plan does not count."""
    body = json.dumps({"settings": plan["settings"], "parts": plan["parts"]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@contextlib.contextmanager
def planned_dir(plan: dict):
    """In the directory the plan was made in, where its relative paths (sources, tokenizer, files)
    lead: a build's tasks may start elsewhere (on other nodes, in a job's own directory)."""
    where, settings = plan.get("planned_in"), plan["settings"]
    relative = [p for p in [*settings["sources"], settings["tokenizer"]] if not os.path.isabs(p)]
    if where is None or not relative or os.path.realpath(where) == os.path.realpath(os.getcwd()):
        yield
        return
    if not os.path.isdir(where):
        raise FileNotFoundError(f"the plan names {', '.join(relative)} relative to {where}, which is not a "
                                "directory here: run the tasks where it is, or plan again with absolute "
                                "--sources and --tokenizer (--overwrite)")
    before = os.getcwd()
    os.chdir(where)
    try:
        yield
    finally:
        os.chdir(before)


def write_atomic(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all (written beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: dict) -> None:
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


def read_json(path: Path) -> dict | None:
    """A JSON file written by write_json_atomic; None when absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_plan(out_dir: Path) -> dict | None:
    return read_json(Path(out_dir) / PLAN_FILE)


def parts_of(plan: dict) -> list[Part]:
    return [Part.from_dict(i, d) for i, d in enumerate(plan["parts"])]


def marker_path(out_dir: Path, part: Part) -> Path:
    return Path(out_dir) / MARKER_DIR / f"{part.name}.json"


def read_marker(out_dir: Path, part: Part, plan: dict) -> dict | None:
    """The completed part's counts, or None when it is not (or not for this plan) complete."""
    marker = read_json(marker_path(out_dir, part))
    return marker if marker is not None and marker.get("plan_id") == plan["plan_id"] else None


def tasks_parts(parts: Sequence[Part], task: int, tasks: int) -> list[Part]:
    """The parts task ``task`` of ``tasks`` builds: every tasks-th part, starting at its own index."""
    if not 0 <= task < tasks:
        raise ValueError(f"task {task} is outside 0..{tasks - 1} (--task must be below --tasks)")
    return list(parts[task::tasks])


def status(out_dir: Path) -> dict:
    """Parts done and to do of the build in ``out_dir``, with the counts of the done ones."""
    plan = read_plan(out_dir)
    if plan is None:
        raise FileNotFoundError(f"no {PLAN_FILE} in {out_dir}: nothing was planned there")
    parts = parts_of(plan)
    done = {p.index: m for p in parts if (m := read_marker(out_dir, p, plan)) is not None}
    return {"parts": len(parts), "done": sorted(done), "todo": [p.index for p in parts if p.index not in done],
            "tokens": sum(s["tokens"] for m in done.values() for s in m["splits"].values()),
            "documents": sum(s["documents"] for m in done.values() for s in m["splits"].values()),
            "bytes_done": sum(parts[i].bytes for i in done), "bytes": sum(p.bytes for p in parts),
            "merged": (Path(out_dir) / "manifest.json").is_file()}
