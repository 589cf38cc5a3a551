"""One reader per corpus file format, each a stream of :class:`Document` that never stops on bad input.

    plain text   .txt .py .md                                   one document per file, origin "path"
                                                                (up to MAX_TEXT_FILE_BYTES, read whole)
    JSON Lines   .jsonl .jsonl.gz .jsonl.zst .json.gz .json.zst  one per line, origin "path:line"
    Parquet      .parquet                                       one per row, origin "path:row" (1-based)

Compressed and Parquet files are streamed (zstd frames and gzip members as they come, Parquet one
row group at a time), so memory stays flat whatever the file size. A bad record (malformed JSON,
a missing, null or non-string text field, bytes that are not UTF-8, a text that is not valid
Unicode such as a lone surrogate escape) is counted in the report and skipped; a bad file (unreadable,
truncated, corrupt) is counted once at the place where it broke, and the records before it are kept.
An input/output error of the file system (EIO, ESTALE, a file gone since it was listed: the
storage, not the data) raises FileReadError instead, so the caller can try again rather than lose
the file's documents; a broken link and a file without read permission count as bad files.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

# Records are read this many rows at a time from a Parquet row group.
PARQUET_BATCH_ROWS = 1024
# A plain-text file is one document, read and tokenized whole: a larger one is a bad file (it would
# hold a worker's memory many times over), not a reason to stop the build.
MAX_TEXT_FILE_BYTES = 1 << 30


def printable(text: str) -> str:
    """`text` with the bytes of a file name that is not UTF-8 (surrogate escapes) as \\xNN, so that it
    prints and serialises anywhere."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class FileReadError(RuntimeError):
    """The file system failed to read a corpus file that is there (see the module doc)."""


# Errors that say the file itself cannot be read, whenever it is tried: counted as bad input.
LASTING_ERRNOS = (errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG, errno.EISDIR)


def check_io(error: BaseException, path: Path, report) -> None:
    """Raise FileReadError for a file-system failure on `path`; return for what is the file's own
    (corrupt data raises OSErrors without an errno, e.g. gzip's BadGzipFile), and for every error
    when the report counts them (report.count_io_errors)."""
    if not isinstance(error, OSError) or error.errno is None or error.errno in LASTING_ERRNOS:
        return
    if (error.errno == errno.ENOENT and path.is_symlink() and not path.exists()) or report.count_io_errors:
        return  # a broken link; or counted as asked
    raise FileReadError(f"could not read {printable(str(path))}: {error.strerror or error} (errno {error.errno}), a "
                        "failure of the file system, not of the file: run the command again") from error


@dataclass(frozen=True)
class Document:
    text: str
    origin: str  # "path" for a whole file, "path:line" / "path:row" for a record


def has_suffix(name: str, suffixes: Sequence[str]) -> bool:
    return any(name.endswith(s) for s in suffixes)


def _valid_unicode(text: str, raw: bytes) -> bool:
    """False for a text holding lone surrogates, which JSON escapes allow and UTF-8 cannot encode.

    Only a record with a ``\\ud...`` escape can hold one, so the encode check runs on those alone.
    """
    if b"\\ud" not in raw and b"\\uD" not in raw:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_text_file(path: Path, report) -> Iterator[Document]:
    try:
        size = path.stat().st_size
        if size > MAX_TEXT_FILE_BYTES:
            limit = MAX_TEXT_FILE_BYTES
            shown = (f"{limit / 2**30:g} GiB" if limit >= 2**30
                     else f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit} bytes")
            report.add(str(path), f"plain-text file over {shown} (one document, read whole): split it into "
                                  "files or JSON Lines records")
            return
        data = path.read_bytes()
    except OSError as e:
        check_io(e, path, report)
        report.add(str(path), f"unreadable ({e.strerror or type(e).__name__})")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        report.add(f"{path} (byte {e.start})", "not UTF-8")  # the offset in the place: one reason for all
        return
    if text:
        yield Document(text, str(path))


class _ZstdReader(io.RawIOBase):
    """A zstd file as a raw stream, frame after frame; a file that ends inside a frame raises EOFError
    (zstandard's own stream_reader ends quietly there, which would lose the rest of a file unnoticed)."""

    CHUNK = 1 << 16  # compressed bytes per step: what one step decompresses stays small

    def __init__(self, path: Path):
        import zstandard

        # Frames of `zstd --long` (windows up to 2 GiB) too: the default limit is 128 MiB, and memory
        # is only taken when a frame asks for it.
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._file = open(path, "rb")
        self._dobj = self._dctx.decompressobj()
        self._pending = memoryview(b"")
        self._in_frame = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._file.read(self.CHUNK)
            if not chunk:
                if self._in_frame:
                    raise EOFError("compressed file ended before the end of its zstd frame (truncated?)")
                return 0
            out = []
            while chunk:
                self._in_frame = True
                out.append(self._dobj.decompress(chunk))
                if not self._dobj.eof:
                    break
                # A frame ended inside this chunk; what follows it starts the next frame.
                chunk = self._dobj.unused_data
                self._dobj = self._dctx.decompressobj()
                self._in_frame = False
            self._pending = memoryview(b"".join(out))
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]  # a view: no copy of the rest
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_zstd(path: Path):
    return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)


def _opener(path: Path) -> Callable:
    if path.name.endswith(".gz"):
        return lambda: gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        return lambda: _open_zstd(path)
    return lambda: open(path, "rb")


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)  # zlib: corrupt gzip data
    try:
        import zstandard
        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def _lines_until(f, position: int, end: int) -> Iterator[bytes]:
    """The lines of ``f`` from ``position`` (a line start) up to byte ``end``."""
    while position < end and (raw := f.readline()):
        position += len(raw)
        yield raw


def _json_lines(path: Path, report, lines: tuple[int, int, int, int] | None = None
                ) -> Iterator[tuple[object, str, bytes]]:
    """(parsed value, origin "path:line", raw line) of each non-blank line that is UTF-8 JSON; with
    ``lines`` (start, end, first line number, file size when planned) those of bytes [start, end)
    of an uncompressed file (a ValueError if the file changed since)."""
    start, end, first_line, planned_bytes = lines or (0, None, 1, None)
    lineno = first_line - 1
    try:
        if path.name.endswith((".gz", ".zst")) and path.stat().st_size == 0:
            # No compressed stream is 0 bytes (a failed download or copy), though both read as empty.
            report.add(str(path), "unreadable (an empty compressed file: truncated?)")
            return
        # Binary lines so one bad line costs only that line, not the whole file.
        with _opener(path)() as f:
            if lines is not None:
                size = os.fstat(f.fileno()).st_size
                if start:
                    f.seek(start - 1)
                if size != planned_bytes or (start and f.read(1) != b"\n"):
                    raise ValueError(f"{printable(str(path))} changed since the build was planned "
                                     f"({planned_bytes} bytes then, {size} now), so its planned line ranges "
                                     "no longer fit it: plan the build again (--overwrite)")
            for lineno, raw in enumerate(f if end is None else _lines_until(f, start, end), start=first_line):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue  # blank lines are harmless padding, not errors
                try:
                    value = json.loads(raw.decode("utf-8-sig"))  # -sig: drops a byte order mark (one opens some files)
                except UnicodeDecodeError:
                    report.add(where, "not UTF-8")
                    continue
                except json.JSONDecodeError:
                    report.add(where, "malformed JSON")
                    continue
                except (ValueError, RecursionError) as e:  # JSON Python will not take: huge integers, deep nesting
                    report.add(where, f"unparsable JSON ({type(e).__name__})")
                    continue
                yield value, where, raw
    except _stream_errors() as e:
        check_io(e, path, report)
        # Unopenable file, or a truncated/corrupt compressed stream partway through.
        where = f"{path}:{lineno + 1}" if lineno >= first_line or start else str(path)
        report.add(where, f"unreadable ({getattr(e, 'strerror', None) or e})")


def read_jsonl_file(path: Path, text_field: str, report, lines: tuple[int, int, int, int] | None = None
                    ) -> Iterator[Document]:
    for rec, where, raw in _json_lines(path, report, lines):
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            report.add(where, f"missing or non-string {text_field!r} field")
            continue
        if not _valid_unicode(text, raw):
            report.add(where, "invalid Unicode (lone surrogate)")
            continue
        if text:
            yield Document(text, where)


def parquet_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises on a corrupt file: ArrowInvalid is a ValueError, but other Arrow errors
    (ArrowNotImplementedError on some damaged footers) are neither that nor an OSError."""
    import pyarrow as pa

    return OSError, ValueError, pa.ArrowException


UNDECODABLE = object()  # a Parquet value pyarrow cannot turn into Python (a string that is not UTF-8)


def _python_values(values) -> Iterator:
    """The values of a pyarrow Array (or the rows of a RecordBatch, as dicts) in Python, UNDECODABLE for
    each that cannot be converted: pyarrow reads strings unchecked, and one bad value fails the whole
    batch's conversion, so only then is it converted value by value."""
    try:
        yield from values.to_pylist()  # converted whole before the first value is yielded
        return
    except ValueError:  # UnicodeDecodeError among them
        pass
    for i in range(len(values)):
        try:
            yield values.slice(i, 1).to_pylist()[0]
        except ValueError:
            yield UNDECODABLE


def read_records(path: Path, report) -> Iterator[tuple[dict, str]]:
    """(record, origin) of every row of a JSON Lines or Parquet file, all fields kept (for data
    made of several fields, such as fine-tuning examples; a Parquet row without its null columns, as a
    JSON object would hold it); rows that are not objects are counted."""
    if has_suffix(path.name, PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except parquet_errors() as e:
            check_io(e, path, report)
            report.add(str(path), f"unreadable ({e})")
            return
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for rec in _python_values(batch):
                    row += 1
                    if rec is UNDECODABLE:
                        report.add(f"{path}:{row}", "not UTF-8")
                    else:  # every row has every column: a null one is a field this row does not have
                        yield {k: v for k, v in rec.items() if v is not None}, f"{path}:{row}"
        except parquet_errors() as e:
            check_io(e, path, report)
            report.add(f"{path}:{row + 1}", f"unreadable ({e})")
        return
    if not has_suffix(path.name, JSONL_SUFFIXES):
        report.add(str(path), f"not a JSON Lines or Parquet file ({', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})")
        return
    for rec, where, _ in _json_lines(path, report):
        if isinstance(rec, dict):
            yield rec, where
        else:
            report.add(where, "not a JSON object")


def parquet_row_groups(path: Path) -> list[tuple[int, int]]:
    """(rows, compressed bytes) of each row group, from the footer alone; [] if unreadable."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except parquet_errors():
        return []
    return [(meta.row_group(i).num_rows,
             sum(meta.row_group(i).column(c).total_compressed_size for c in range(meta.num_columns)))
            for i in range(meta.num_row_groups)]


def is_text(arrow_type) -> bool:
    """Strings in any of Arrow's layouts: string, large_string, string_view, or dictionary-encoded
    (what pandas writes for a categorical column)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type)


def read_parquet_file(path: Path, text_field: str, report, row_groups: Sequence[int] | None = None,
                      layout: tuple[int, int] | None = None) -> Iterator[Document]:
    """Rows of ``row_groups`` (default: all) of a Parquet file, one row group in memory at a time
    (``layout``: the file's size and row-group count when the groups were planned; a ValueError if
    it changed since). A corrupt row group is counted and the next one read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # Without pre-buffering, pyarrow reads a column chunk in pieces, not whole: a file written as
        # one row group of gigabytes stays in bounded memory.
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except parquet_errors() as e:
        check_io(e, path, report)
        report.add(str(path), f"unreadable ({e})")
        return
    if layout is not None and (os.path.getsize(path), pf.metadata.num_row_groups) != tuple(layout):
        size, groups = layout
        raise ValueError(f"{printable(str(path))} changed since the build was planned ({size} bytes in {groups} "
                         f"row groups then, {os.path.getsize(path)} in {pf.metadata.num_row_groups} now), so its "
                         "planned row groups no longer fit it: plan the build again (--overwrite)")
    schema = pf.schema_arrow
    groups = range(pf.metadata.num_row_groups) if row_groups is None else row_groups
    rows = sum(pf.metadata.row_group(g).num_rows for g in groups)  # what this call would have read
    if text_field not in schema.names:  # all of them lost: counted as that many
        report.add(str(path), f"no {text_field!r} column (columns: {', '.join(schema.names)})", rows)
        return
    column_type = schema.field(text_field).type
    if not is_text(column_type):
        report.add(str(path), f"column {text_field!r} is {column_type}, not a string", rows)
        return
    plain = pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
    for group in groups:
        first = row = sum(pf.metadata.row_group(g).num_rows for g in range(group))  # rows before this group
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[text_field]):
                texts = batch.column(0) if plain else batch.column(0).cast(pa.large_string())  # views, categories
                for text in _python_values(texts):
                    row += 1
                    if text is UNDECODABLE:
                        report.add(f"{path}:{row}", "not UTF-8")
                    elif text is None:
                        report.add(f"{path}:{row}", f"missing or non-string {text_field!r} field")
                    elif text:
                        yield Document(text, f"{path}:{row}")
        except parquet_errors() as e:
            check_io(e, path, report)
            lost = pf.metadata.row_group(group).num_rows - (row - first)  # its rows from here on
            report.add(f"{path}:{row + 1} (row group {group}, {lost} rows)", f"unreadable row group ({e})", lost)


def read_file(path: Path, text_field: str, report, row_groups: Sequence[int] | None = None,
              lines: tuple[int, int, int, int] | None = None, layout: tuple[int, int] | None = None
              ) -> Iterator[Document]:
    """The documents of one corpus file, by its suffix (``row_groups`` and their planned ``layout``
    only for Parquet, ``lines``, a byte range, its first line number and the file's planned size,
    only for uncompressed JSON Lines)."""
    if has_suffix(path.name, PARQUET_SUFFIXES):
        return read_parquet_file(path, text_field, report, row_groups, layout)
    if has_suffix(path.name, JSONL_SUFFIXES):
        return read_jsonl_file(path, text_field, report, lines)
    return read_text_file(path, report)
