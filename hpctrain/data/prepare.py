"""``hpctrain prepare``: documents -> one HDF5 token file, on any number of ranks.

Every rank lists the same units of work (text files, byte ranges of JSONL files, compressed
JSONL files, Parquet row groups: :mod:`hpctrain.data.documents`; the embedded corpus; or the
documents of a tokenized ``nanogpt``/``megatron`` corpus, :mod:`hpctrain.data.corpora`) and
takes a contiguous block of them, balanced by size. It streams its block: documents are
tokenized a batch at a time (:mod:`hpctrain.data.tokenizer`), each one's split picked by a
hash of its content (``data.is_validation``: the text's bytes, or the token ids as
little-endian uint32), never by rank or position, and appended to the rank's spill files
(:mod:`hpctrain.data.spill`). One all-gather of the counts gives every rank its offsets; the
file is created collectively (h5py's ``mpio`` driver on the world communicator, like
checkpoints) and each rank copies its spill files into its slices. Rank 0 then hashes the
tokens (``content_hash``: sha256 of train then val tokens) and renames ``OUT.tmp`` to ``OUT``
once an all-gather has shown that every rank wrote its slices (any rank's failure, a bad
record included: ``OUT.tmp`` is removed, ``OUT`` untouched, every rank raises
:class:`DataError` naming the failing rank). The file is the same, byte for byte, for any
number of ranks (more ranks than units included) and either writer.

Layout (docs/data.md)::

    /train/tokens, /val/tokens           uint8 (bytes), uint16 (vocab <= 65536) or uint32
    /train/doc_starts, /val/doc_starts   int64: where each document starts in its split
    /tokenizer_json                      uint8: the tokenizer.json text (absent for bytes)
    attrs: tokenizer, tokenizer_hash, vocab_size, max_token_id, content_hash, documents,
           train_documents, val_documents, train_tokens, val_tokens, val_fraction,
           source_format, sources, source_counts (JSON: per input), created_by, eot
           (``--from nanogpt``), skipped_hidden, skipped_binary, skipped_records and
           skipped_files (text)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import documents
from .corpora import FormatError, read
from .dataset import DataError, is_validation, stdlib_documents
from .documents import BINARY, Bad, binary
from .spill import Spill, attempt, oneline, tokens_hash, write
from .tokenizer import Tokenizer, TokenizerError, token_dtype

__all__ = ["Source", "binary", "blocks", "embedded_source", "prepare", "text_source",
           "token_source", "tokens_hash"]
BATCH = 256  # documents encoded per call of the tokenizer


@dataclass
class Source:
    """The units to prepare: ``records(i)`` yields unit i's documents (bytes of text or token
    ids, :data:`documents.BINARY`, :class:`documents.Bad`); without it unit i is the one
    document ``load(i)``. ``inputs`` name the sources counted apart, ``source[i]`` is unit
    i's."""

    form: str  # "text", "nanogpt" or "megatron"
    names: list[str]
    sizes: np.ndarray  # bytes or tokens per unit (for balancing the blocks)
    load: Callable[[int], object] | None = None
    eot: int | None = None
    hidden: int = 0  # hidden files and directories left out of the listing
    binary: bool = False  # read binary files too (else each is left out and counted)
    records: Callable[[int], Iterable] | None = None
    inputs: list[str] = field(default_factory=list)
    source: np.ndarray | None = None

    def read(self, i: int) -> Iterable:
        if self.records is not None:
            return self.records(i)
        doc = self.load(i)
        skip = self.form == "text" and not self.binary and binary(doc)
        return [BINARY if skip else doc]

    def texts(self, i: int) -> list[bytes]:
        """Unit i's text documents (bad records and binary files left out)."""
        return [d for d in self.read(i) if isinstance(d, bytes)]


def text_source(paths: list[str], hidden: bool = False, binary: bool = False,
                key: str = "text", chunk: int = 0, group=None) -> Source:
    """Files, directories (every regular file below that is not hidden, unless ``hidden``)
    and globs, in the global order of :func:`documents.listing` (a file named in ``paths`` is
    read even when its name starts with a dot); JSONL and Parquet files by their suffix,
    their documents in the field or column ``key``; ``binary``: binary text files are
    documents too. With ``group`` (collective) rank 0 alone lists the files and reads the
    Parquet footers and broadcasts the units or its error, so that a parallel file system
    sees one listing, not one per rank."""
    def listed() -> tuple[list[documents.Unit], int]:
        files, left_out = documents.listing(paths, hidden)
        if not files:
            raise DataError(f"no input documents in {', '.join(paths)}")
        return documents.units(files, chunk), left_out

    if group is None or group.size == 1:
        units, left_out = listed()
    else:
        got = None
        if group.rank == 0:
            try:
                got = listed()
            except DataError as e:
                got = str(e)
        got = group.bcast_obj(got)
        if isinstance(got, str):
            raise DataError(got)
        units, left_out = got
    return Source("text", [u.path for u in units], np.array([u.size for u in units],
                                                            dtype=np.int64),
                  hidden=left_out, binary=binary,
                  records=lambda i: documents.read(units[i], key, binary), inputs=list(paths),
                  source=np.array([u.source for u in units], dtype=np.int64))


def embedded_source(corpus_mb: float) -> Source:
    """The embedded corpus (Python's standard-library sources, data.stdlib_documents)."""
    docs = stdlib_documents(int(corpus_mb * 2**20))
    return Source("text", [f"embedded:{name}" for name, _ in docs],
                  np.array([len(d) for _, d in docs], dtype=np.int64), lambda i: docs[i][1],
                  binary=True)  # as data.load_tokens reads it


def token_source(kind: str, path: str, eot: int | None) -> Source:
    """A tokenized corpus (``eot`` None: the end-of-text id its file implies)."""
    try:
        corpus = read(kind, path, eot)
    except FormatError as e:
        raise DataError(str(e)) from None
    if not len(corpus):
        raise DataError(f"{path}: no tokens")
    return Source(kind, [f"{kind}:{path}"], corpus.sizes, corpus.document,
                  corpus.eot)


def blocks(sizes: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [lo, hi) ranges of documents with about equal total size."""
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    cuts = [0] + [int(np.searchsorted(ends, total * k / parts, side="right"))
                  for k in range(1, parts)] + [len(sizes)]
    cuts = list(np.maximum.accumulate(cuts))
    return [(cuts[k], cuts[k + 1]) for k in range(parts)]


@dataclass
class Tally:
    """One rank's counts: ``per_source`` rows [train tokens, val tokens, train documents,
    val documents] per input; the largest id; files left out as binary; bad records and
    files skipped."""

    per_source: np.ndarray
    top: int = -1
    binary: int = 0
    bad_records: int = 0
    bad_files: int = 0

    def row(self) -> list[int]:
        return [self.top, self.binary, self.bad_records, self.bad_files]


def stream(src: Source, tok: Tokenizer | None, lo: int, hi: int, val_fraction: float,
           spill: Spill, skip_bad: bool = False) -> Tally:
    """Units lo..hi-1 of ``src`` tokenized a batch at a time into ``spill``, each document in
    the split its content's hash picks; a bad record raises :class:`DataError` (file and
    line) unless ``skip_bad`` (then it is counted)."""
    tally = Tally(np.zeros((max(len(src.inputs), 1), 4), dtype=np.int64))
    batch: list[tuple[object, int]] = []
    for u in range(lo, hi):
        k = int(src.source[u]) if src.source is not None else 0
        for rec in src.read(u):
            if isinstance(rec, Bad):
                if not skip_bad:
                    raise DataError(f"{rec.where}: {rec.why} (--skip-bad-records skips and "
                                    "counts such records)")
                tally.bad_files += rec.file
                tally.bad_records += not rec.file
            elif rec is BINARY:
                tally.binary += 1
            else:
                batch.append((rec, k))
                if len(batch) == BATCH:
                    _encode(batch, src, tok, val_fraction, spill, tally)
                    batch = []
    _encode(batch, src, tok, val_fraction, spill, tally)
    return tally


def _encode(batch: list, src: Source, tok: Tokenizer | None, val_fraction: float,
            spill: Spill, tally: Tally) -> None:
    docs = [d for d, _ in batch]
    if not docs:
        return
    if src.form == "text":
        ids, keys = tok.encode(docs), docs
    else:
        ids, keys = docs, [np.asarray(d).astype("<u4").tobytes() for d in docs]
    for d, key, (_, k) in zip(ids, keys, batch):
        val = is_validation(key, val_fraction)
        spill.add("val" if val else "train", d)
        tally.per_source[k] += (0, d.size, 0, 1) if val else (d.size, 0, 1, 0)
        if d.size:
            tally.top = max(tally.top, int(d.max()))


def prepare(src: Source, tok: Tokenizer | None, out: str, val_fraction: float = 0.05,
            group=None, skip_bad: bool = False) -> dict:
    """Write ``out`` from ``src`` on every rank of ``group`` (a ``comm.Group``; None: this
    process alone, serial HDF5). Collective; returns the file's attributes on every rank.
    Anything wrong on any rank (a source, a bad record unless ``skip_bad``, the tokenizer,
    ``out``, a write) raises :class:`DataError` alike on every rank, naming the rank, and
    nothing is left at ``out`` (a file already there is untouched). Every rank's outcome is
    all-gathered after each phase in which ranks act alone (reading and tokenizing; writing
    its slices), so a rank that fails there still takes part in the next collective."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    lo, hi = blocks(src.sizes, size)[rank]
    tmp = str(Path(out).with_name(Path(out).name + ".tmp"))
    spill, tally = None, None
    why = attempt(lambda: Path(out).parent.mkdir(parents=True, exist_ok=True),
                  f"cannot write {out}")  # every rank: exist_ok races fine
    try:
        if why is None:
            try:
                spill = Spill(f"{tmp}.{rank}", tok.dtype if tok is not None and
                              src.form == "text" else np.uint32)
                tally = stream(src, tok, lo, hi, val_fraction, spill, skip_bad)
                spill.close()
            except OSError as e:
                why = f"cannot write {out}: {oneline(e)}"
            except (DataError, FormatError, TokenizerError) as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - any error must reach the all-gather
                why = f"{type(e).__name__}: {e}"
        every = _gather(group, (why, None if tally is None else
                                (tally.per_source.tolist(), tally.row())))
        _raise_failed([w for w, _ in every])
        return _commit(src, tok, out, tmp, val_fraction, group, spill, every)
    finally:
        if spill is not None:
            spill.remove()


def _commit(src: Source, tok: Tokenizer | None, out: str, tmp: str, val_fraction: float,
            group, spill: Spill, every: list) -> dict:
    """Every rank's counts in hand: the attributes, the file written together, rank 0's
    hash and rename, the verdict shared."""
    rank = group.rank if group is not None else 0
    per_rank = np.array([c[0] for _, c in every], dtype=np.int64)  # rank, input, 4 counts
    rows = np.array([c[1] for _, c in every], dtype=np.int64)  # rank, Tally.row()
    attrs = _attrs(src, tok, per_rank.sum(axis=0), rows, val_fraction)
    if src.form == "text" and not attrs["documents"]:
        raise DataError(f"no text documents in {', '.join((src.inputs or src.names)[:3])}: "
                        f"{attrs['skipped_binary']} binary file(s), "
                        f"{attrs['skipped_records']} bad record(s) and "
                        f"{attrs['skipped_files']} bad file(s) skipped")
    dtype = (tok.dtype if tok is not None and src.form == "text"
             else token_dtype(max(attrs["vocab_size"], attrs["max_token_id"] + 1)))
    totals = per_rank.sum(axis=1)  # rank, 4 counts
    why = write(group, tmp, spill, dtype, totals.sum(axis=0), totals[:rank].sum(axis=0),
                attrs, tok)
    every = _gather(group, None if why is None else f"cannot write {out}: {why}")
    if rank == 0 and any(every) and Path(tmp).is_file():
        Path(tmp).unlink()
    _raise_failed(every)
    why = _finish(tmp, out, attrs) if rank == 0 else None
    if group is not None:
        why, attrs["content_hash"] = group.bcast_obj((why, attrs.get("content_hash")))
    if why:
        if rank == 0 and Path(tmp).is_file():
            Path(tmp).unlink()
        raise DataError(why)
    return attrs


def _raise_failed(why: list) -> None:
    """Raise the first rank's error (every rank gets the same list), naming the rank when
    there are several."""
    failed = [r for r, w in enumerate(why) if w]
    if not failed:
        return
    if len(why) == 1:
        raise DataError(why[0])
    more = f" (and rank(s) {', '.join(map(str, failed[1:]))})" if failed[1:] else ""
    raise DataError(f"rank {failed[0]} of {len(why)}{more}: {why[failed[0]]}")


def _gather(group, obj) -> list:
    return group.allgather_obj(obj) if group is not None else [obj]


def _attrs(src: Source, tok: Tokenizer | None, per_source: np.ndarray, rows: np.ndarray,
           val_fraction: float) -> dict:
    top = int(rows[:, 0].max())
    if tok is not None:
        name, digest, vocab = tok.name, tok.hash, tok.vocab_size
    else:  # tokens without their tokenizer: the vocabulary the ids need
        name, digest, vocab = f"{src.form} token ids", "", max(top, src.eot or 0) + 1
    total = per_source.sum(axis=0)
    attrs = {"tokenizer": name, "tokenizer_hash": digest, "vocab_size": int(vocab),
             "max_token_id": top, "documents": int(total[2] + total[3]),
             "train_documents": int(total[2]), "val_documents": int(total[3]),
             "train_tokens": int(total[0]), "val_tokens": int(total[1]),
             "val_fraction": float(val_fraction), "source_format": src.form,
             "sources": "\n".join(dict.fromkeys(src.names))[:60000],
             "source_counts": source_counts(src.inputs or [src.form], per_source),
             "created_by": "hpctrain prepare"}
    if src.eot is not None:
        attrs["eot"] = int(src.eot)
    if src.form == "text":
        attrs.update(skipped_hidden=src.hidden, skipped_binary=int(rows[:, 1].sum()),
                     skipped_records=int(rows[:, 2].sum()), skipped_files=int(rows[:, 3].sum()))
    return attrs


def source_counts(inputs: list[str], per_source: np.ndarray, limit: int = 60000) -> str:
    """The ``source_counts`` attribute: JSON, one entry per input; past ``limit`` characters
    the last inputs are summed into one entry named ``(N more inputs)``."""
    rows = [{"source": s, "train_documents": int(c[2]), "val_documents": int(c[3]),
             "train_tokens": int(c[0]), "val_tokens": int(c[1])}
            for s, c in zip(inputs, per_source)]
    keep = len(rows)
    while len(text := json.dumps(rows[:keep] + _rest(rows[keep:]))) > limit:
        keep = keep // 2
    return text


def _rest(rows: list[dict]) -> list[dict]:
    if not rows:
        return []
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "source"}
    return [{"source": f"({len(rows)} more inputs)", **total}]


def _finish(tmp: str, out: str, attrs: dict) -> str | None:
    """Rank 0, after the collective close: the content hash, then the atomic rename."""
    import h5py

    def commit() -> None:
        with h5py.File(tmp, "r+") as f:
            attrs["content_hash"] = tokens_hash(f)
            f.attrs["content_hash"] = attrs["content_hash"]
        os.replace(tmp, out)

    return attempt(commit, f"cannot write {out}")
