"""Corpus sources: which files of the given paths are corpus, and their documents as one stream.

Supported inputs (any number of them, mixed):

* a directory tree: every file below it of a type in ``readers.ALL_SUFFIXES`` (plain text, JSON
  Lines plain/gzip/zstd, Parquet), walked recursively in sorted order so runs are reproducible;
* a single file of one of those types;
* a :class:`Source` with its own suffix filter and excluded directory names
  (this is how :func:`default_corpus` restricts the standard library to ``.py``).

How each format is read, and what counts as a bad record, is in :mod:`data_prep.readers`. Bad input
never stops a run halfway: it is skipped and counted in a :class:`BadInputReport`, which keeps the
first few examples so the user can find them.
"""

from __future__ import annotations

import os
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from data_prep.readers import ALL_SUFFIXES, Document, has_suffix, printable, read_file

__all__ = ["ALL_SUFFIXES", "BadInputReport", "Document", "EmptyCorpusError", "Source", "as_sources",
           "default_corpus", "iter_documents", "list_files", "printable", "require_documents",
           "source_relative"]

# Directories of the standard library left out of the default corpus: installed
# third-party packages are not part of Python, and the test suites are large
# (about as big as the rest together), repetitive, and contain deliberately
# broken or non-UTF-8 files.
DEFAULT_CORPUS_EXCLUDES = ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")


class EmptyCorpusError(ValueError):
    """The given sources contain no documents at all."""


@dataclass(frozen=True)
class Source:
    """A file or directory plus which files below it count as corpus."""

    path: Path
    suffixes: tuple[str, ...] = ALL_SUFFIXES
    exclude_dirs: tuple[str, ...] = ()

    def __str__(self) -> str:
        return str(self.path)


@dataclass
class BadInputReport:
    """Counts skipped inputs and keeps the first ``max_examples`` for the summary.
    ``count_io_errors``: a file-system error reading a file counts it as unreadable too, instead of
    raising FileReadError (data_prep.readers)."""

    max_examples: int = 5
    count: int = 0
    by_reason: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    count_io_errors: bool = False

    def add(self, where: str, reason: str, records: int = 1) -> None:
        """`records`: how many inputs this one failure costs (the rows of a corrupt row group)."""
        self.count += records
        self.by_reason[reason] += records
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{printable(where)}: {reason}")

    def to_dict(self) -> dict:
        return {"count": self.count, "by_reason": dict(sorted(self.by_reason.items())),
                "examples": list(self.examples)}

    def merge(self, other: dict) -> None:
        """Add the counts of another report's :meth:`to_dict` (the reports of a build's parts)."""
        self.count += other["count"]
        self.by_reason.update(other["by_reason"])
        self.examples += other["examples"][: self.max_examples - len(self.examples)]

    def summary(self) -> str:
        if not self.count:
            return "bad inputs: none"
        lines = [f"bad inputs: {self.count} skipped ("
                 + ", ".join(f"{n} {r}" for r, n in sorted(self.by_reason.items())) + ")"]
        lines += [f"  {e}" for e in self.examples]
        if self.count > len(self.examples):
            lines.append(f"  ... and {self.count - len(self.examples)} more")
        return "\n".join(lines)


def default_corpus() -> Source:
    """The running Python's standard library ``.py`` files: a corpus that needs no download.

    Picks every ``.py`` file under ``sysconfig.get_paths()['stdlib']`` except the
    directories in ``DEFAULT_CORPUS_EXCLUDES`` (site-packages, test suites, idlelib):
    on CPython 3.11 about 670 files / 11 MB of text / 3.5M tokens at a 4k vocabulary.
    """
    return Source(Path(sysconfig.get_paths()["stdlib"]), suffixes=(".py",),
                  exclude_dirs=DEFAULT_CORPUS_EXCLUDES)


def as_sources(sources: Iterable[str | os.PathLike | Source] | str | os.PathLike | Source | None
               ) -> list[Source]:
    """Normalise user input (paths, Source objects, or None for the default corpus)."""
    if sources is None:
        return [default_corpus()]
    if isinstance(sources, (str, os.PathLike, Source)):
        sources = [sources]
    out = [s if isinstance(s, Source) else Source(Path(s)) for s in sources]
    if not out:
        return [default_corpus()]
    return out


def list_files(sources, skipped: Counter | None = None, progress: bool = False) -> list[Path]:
    """All corpus files of ``sources`` in a deterministic order, each once (sources that overlap, such
    as a folder and a file or subfolder inside it, would otherwise train on those files twice).
    Symlinked folders are followed (each real folder once). ``skipped`` counts, by last suffix, the
    files of a folder given with the default suffixes that no reader takes.

    A source path that does not exist, or a single file of an unsupported type, is
    an error right away: it is almost always a typo, and finding out after an hour
    of processing the other sources would be worse. ``progress``: a count of the files on stderr.
    """
    files: list[Path] = []
    counter = tqdm(unit=" files", desc="listing corpus files", disable=not progress, mininterval=1.0)
    for src in as_sources(sources):
        p = src.path
        if p.is_dir():
            seen = {os.path.realpath(p)}
            for dirpath, dirnames, filenames in os.walk(p, followlinks=True):
                # Sorting in place also fixes the order os.walk descends in; a folder reached again
                # through a link (a link to an ancestor would loop) is left out.
                kept = []
                for d in sorted(dirnames):
                    real = os.path.realpath(os.path.join(dirpath, d))
                    if d not in src.exclude_dirs and real not in seen:
                        seen.add(real)
                        kept.append(d)
                dirnames[:] = kept
                for f in sorted(filenames):
                    if has_suffix(f, src.suffixes):
                        files.append(Path(dirpath) / f)
                        counter.update()
                    elif skipped is not None and src.suffixes == ALL_SUFFIXES:
                        suffix = printable(Path(f).suffix)
                        skipped[suffix if 1 < len(suffix) <= 12 else "(no suffix)" if not suffix else "(other)"] += 1
        elif p.exists() or p.is_symlink():
            if not has_suffix(p.name, ALL_SUFFIXES):
                raise ValueError(f"unsupported corpus file {p}: expected one of {', '.join(ALL_SUFFIXES)}")
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus source not found: {p}")
    counter.close()
    firsts = {}  # resolved path -> the path first listed for it (dicts keep insertion order)
    for f in files:
        # realpath, not Path.resolve: a link loop raises there; here it stays listed and its read
        # counts it as unreadable
        firsts.setdefault(os.path.realpath(f), f)
    return list(firsts.values())


def source_relative(path: str | os.PathLike, sources: Sequence[str | os.PathLike]) -> str:
    """``path`` relative to the first of ``sources`` that holds it (a file given as a source: its
    name), the same wherever the corpus lies; a ValueError if none holds it."""
    for src in map(Path, sources):
        if Path(path) == src:
            return src.name
        rel = os.path.relpath(path, src)
        if rel != ".." and not rel.startswith(".." + os.sep):
            return rel
    raise ValueError(f"{path} lies in none of the corpus sources {[str(s) for s in sources]}")


def iter_documents(sources=None, *, text_field: str = "text", report: BadInputReport | None = None,
                   max_docs: int | None = None, files: Sequence[Path] | None = None) -> Iterator[Document]:
    """Yield non-empty documents from ``sources`` (None = :func:`default_corpus`; ``files``: their
    files, listed already)."""
    report = report if report is not None else BadInputReport()
    n = 0
    for path in list_files(sources) if files is None else files:
        for doc in read_file(path, text_field, report):
            if max_docs is not None and n >= max_docs:
                return
            n += 1
            yield doc


def require_documents(sources=None, *, text_field: str = "text", files: Sequence[Path] | None = None,
                      skip_unreadable: bool = False) -> None:
    """Fail fast, before any expensive work, if ``sources`` hold no document at all (``files``: their
    files, listed already: a corpus of millions of files is not walked again; ``skip_unreadable``: a
    file the file system fails to read is passed over, as the command will count it)."""
    srcs = as_sources(sources)
    report = BadInputReport(count_io_errors=skip_unreadable)
    if next(iter_documents(srcs, text_field=text_field, files=files, report=report), None) is None:
        names = ", ".join(str(s) for s in srcs)
        suffixes = sorted({x for s in srcs for x in s.suffixes})
        raise EmptyCorpusError(
            f"empty corpus: no documents found in {names} (looked for non-empty, readable "
            f"{' / '.join(suffixes)} files; JSON Lines records and Parquet rows need a string {text_field!r} field, see --text-field). "
            "Pass --sources with a directory or file that contains text, or leave --sources out "
            "to use the built-in default corpus (the Python standard library).")
