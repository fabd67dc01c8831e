"""The documents ``hpctrain prepare`` reads: the listing of its inputs, the units of work the
ranks share, and one reader per format.

Inputs are files, directories (every regular file below, sorted, hidden ones left out unless
asked) and globs (``data/*.parquet``, ``shards/**/*.jsonl.zst``: sorted). A file's format
comes from its name: ``.jsonl``/``.json`` (one JSON record per line, the document in the field
``key``), the same with ``.gz`` or ``.zst``, ``.parquet`` (the column ``key``); any other file is
one text document. The global order of the documents is the order of the inputs as given,
the files of each in sorted order, then the records in file order.

A :class:`Unit` is what one rank reads alone: a text file, a byte range of a plain JSONL file
(:data:`CHUNK` bytes; a record belongs to the range its line starts in), a whole compressed
JSONL file (a stream cannot be entered in the middle) or one row group of a Parquet file.
The units are listed from file sizes and Parquet footers only, so every rank lists the same
units without reading any document. A reader yields, per record, the document's bytes
(UTF-8 text), :data:`BINARY` (a text file left out as binary) or a :class:`Bad` record
naming the file and line (the record number for Parquet).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .dataset import DataError

CHUNK = 64 << 20  # bytes of a plain JSONL file per unit
ROWS = 1024  # Parquet rows decoded at a time
JSONL = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
         ".jsonl.zst": "jsonl.zst", ".json.zst": "jsonl.zst", ".parquet": "parquet"}

# How a file that is not text starts: ELF, gzip, zip, bzip2, xz, zstd, 7-Zip, PNG, JPEG,
# Mach-O (both byte orders); any NUL byte in the first SNIFF bytes also marks a binary file.
SIGNATURES = (b"\x7fELF", b"\x1f\x8b", b"PK\x03\x04", b"BZh", b"\xfd7zXZ\x00",
              b"\x28\xb5\x2f\xfd", b"7z\xbc\xaf\x27\x1c", b"\x89PNG", b"\xff\xd8\xff",
              b"\xcf\xfa\xed\xfe", b"\xfe\xed\xfa\xcf")
SNIFF = 8192
BINARY = object()  # a text file left out as binary


def binary(doc: bytes) -> bool:
    """Whether a file's bytes are not text: a NUL byte near the start, or the signature of an
    executable, archive or image."""
    return b"\x00" in doc[:SNIFF] or doc.startswith(SIGNATURES)


@dataclass(frozen=True)
class Bad:
    """A record that is not a document: ``where`` (``path:line`` or ``path: record N``),
    ``why``; ``file``: the whole file (a Parquet column that is missing or not text)."""

    where: str
    why: str
    file: bool = False


class Unit(NamedTuple):
    """Part of one file read by one rank: ``lo``..``hi`` are the byte range of a plain JSONL
    file, or the row group and the rows before it for Parquet (0, size otherwise)."""

    path: str
    fmt: str  # "text", "jsonl", "jsonl.gz", "jsonl.zst" or "parquet"
    source: int  # which input (command-line argument) it comes from
    size: int  # bytes, for balancing
    lo: int
    hi: int


def file_format(path: str) -> str:
    name = path.lower()
    for suffix in sorted(JSONL, key=len, reverse=True):
        if name.endswith(suffix):
            return JSONL[suffix]
    return "text"


def listing(paths: list[str], hidden: bool = False) -> tuple[list[tuple[Path, int]], int]:
    """Every file of ``paths`` with the index of the input it came from, in the global
    order, and how many hidden entries were left out."""
    files, left_out = [], 0
    for k, s in enumerate(paths):
        p = Path(s)
        if p.is_dir():
            found, n = _walk(p, hidden)
        elif p.is_file():
            found, n = [p], 0
        elif glob.has_magic(s):
            found, n = [], 0
            for m in sorted(glob.glob(s, recursive=True)):
                more, h = _walk(Path(m), hidden) if Path(m).is_dir() else ([Path(m)], 0)
                found, n = found + more, n + h
            if not found:
                raise DataError(f"{s} matches no file")
        else:
            raise DataError(f"{s} is neither a file nor a directory")
        files += [(f, k) for f in found]
        left_out += n
    return files, left_out


def _walk(top: Path, keep_hidden: bool) -> tuple[list[Path], int]:
    """The regular files below ``top``, sorted, and how many hidden entries were left out
    (a hidden directory counts once and is not entered)."""
    files, hidden = [], 0
    for root, dirs, names in os.walk(top):
        if not keep_hidden:
            hidden += sum(1 for d in dirs if d.startswith("."))
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith(".") and not keep_hidden:
                hidden += 1
            elif (Path(root) / name).is_file():
                files.append(Path(root) / name)
    return sorted(files), hidden


def units(files: list[tuple[Path, int]], chunk: int = 0) -> list[Unit]:
    """The units of ``files`` in the global order (``chunk``: bytes per plain JSONL unit)."""
    out = []
    for path, k in files:
        fmt, size = file_format(path.name), path.stat().st_size
        if fmt == "jsonl":
            step = chunk or CHUNK
            out += [Unit(str(path), fmt, k, min(step, size - a), a, min(a + step, size))
                    for a in range(0, max(size, 1), step)]
        elif fmt == "parquet":
            out += _row_groups(path, k)
        else:
            out.append(Unit(str(path), fmt, k, size, 0, size))
    return out


def _row_groups(path: Path, k: int) -> list[Unit]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own kinds
        raise DataError(f"{path}: not a Parquet file ({_oneline(e)})") from None
    out, rows = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        out.append(Unit(str(path), "parquet", k, group.total_byte_size, g, rows))
        rows += group.num_rows
    return out


def read(u: Unit, key: str = "text", keep_binary: bool = False) -> Iterator:
    """The records of unit ``u``: bytes, :data:`BINARY` or :class:`Bad`."""
    if u.fmt == "text":
        try:
            doc = Path(u.path).read_bytes()
        except OSError as e:
            raise DataError(f"{u.path} cannot be read: {e.strerror or e}") from None
        yield doc if keep_binary or not binary(doc) else BINARY
    elif u.fmt == "parquet":
        yield from _parquet(u, key)
    else:
        yield from _jsonl(u, key)


def _jsonl(u: Unit, key: str) -> Iterator:
    for at, line in _lines(u):
        if not line.strip():
            continue  # blank lines separate nothing
        doc, why = record(line, key)
        if why is None:
            yield doc
        else:
            yield Bad(f"{u.path}:{_line_of(u.path, at) if u.fmt == 'jsonl' else at}", why)


def record(line: bytes, key: str) -> tuple[bytes | None, str | None]:
    """One JSONL line's document as UTF-8 bytes, or None and why it is not one."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {e.start} of the line)"
    except ValueError as e:
        return None, f"bad JSON ({e})"
    if not isinstance(rec, dict) or key not in rec:
        return None, f"no field {key!r} (--text-key names the field)"
    value = rec[key]
    if not isinstance(value, str):
        return None, f"field {key!r} is {type(value).__name__}, not a string"
    try:
        return value.encode("utf-8"), None
    except UnicodeEncodeError:
        return None, f"field {key!r} is not UTF-8 text (a lone surrogate escape)"


def _lines(u: Unit) -> Iterator[tuple[int, bytes]]:
    """(where, line): the byte offset for a plain file, the line number (from 1) for a
    compressed one."""
    if u.fmt != "jsonl":
        try:
            with _decompressed(u) as f:
                yield from enumerate(f, 1)
        except Exception as e:  # noqa: BLE001 - gzip and zstandard raise their own kinds
            raise DataError(f"{u.path} cannot be read as {u.fmt}: {_oneline(e)}") from None
        return
    with open(u.path, "rb") as f:
        pos = u.lo
        if pos:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # a line begun before this unit belongs to the one before
                pos += len(f.readline())
        while pos < u.hi:
            line = f.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _decompressed(u: Unit):
    if u.fmt == "jsonl.gz":
        return gzip.open(u.path, "rb")
    import zstandard

    raw = open(u.path, "rb")  # noqa: SIM115 - closed with the reader
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))


def _line_of(path: str, offset: int, block: int = 1 << 20) -> int:
    """The line number (from 1) of the line starting at byte ``offset`` (read only when a
    record is bad)."""
    n = 1
    with open(path, "rb") as f:
        while offset > 0:
            data = f.read(min(block, offset))
            n, offset = n + data.count(b"\n"), offset - len(data)
    return n


def _parquet(u: Unit, key: str) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = pq.ParquetFile(u.path)
    schema = f.schema_arrow
    if schema.get_field_index(key) < 0 or not (pa.types.is_string(schema.field(key).type) or
                                               pa.types.is_large_string(schema.field(key).type)):
        if u.lo == 0:  # said once per file
            what = (f"column {key!r} is {schema.field(key).type}, not strings"
                    if schema.get_field_index(key) >= 0 else
                    f"no column {key!r} (columns: {', '.join(schema.names)[:200]}; "
                    "--text-key names the column)")
            yield Bad(u.path, what, file=True)
        return
    row = u.hi
    for batch in f.iter_batches(batch_size=ROWS, row_groups=[u.lo], columns=[key],
                                use_threads=False):
        for value in batch.column(0).cast(pa.large_binary()).to_pylist():
            row += 1
            yield Bad(f"{u.path}: record {row}", f"{key!r} is null") if value is None else value


def _oneline(e: Exception) -> str:
    return " ".join(str(e).split())
