"""Token data: reading prepared HDF5 files (lazily) and an embedded corpus (byte-level, or
tokenized with ``data.tokenizer``); the checks before a run. Which windows a step trains on
is :mod:`hpctrain.data.sampler` (re-exported here); writing the files is
:mod:`hpctrain.data.prepare` (``hpctrain prepare``).

Layout of a dataset file (docs/data.md)::

    /train/tokens   uint8, uint16 or uint32 (N,)   documents concatenated
    /val/tokens     the held-out documents (chosen by a hash of each document, not by position)
    /train/doc_starts, /val/doc_starts   where each document starts (files from before: absent)
    /tokenizer_json the tokenizer.json text as uint8 (absent for byte-level tokens)
    attrs: tokenizer, tokenizer_hash, vocab_size, max_token_id (the largest id in either
           split), content_hash (sha256 of all tokens), documents, sources, val_fraction, ...

Before a run (every rank, no collective) :func:`summarize` reads what a file says about itself
(files prepared before ``max_token_id`` was recorded are read for it) and :func:`fit_problems`
says whether a model can train on it: the vocabulary must cover the largest id and the
tokenizer's vocabulary (byte-level data: only the largest id).

Reading: :func:`load_tokens` opens a prepared split lazily (:class:`TokenFile`): a rank
reads only the windows it trains on, with positional reads at the dataset's offset in the
file (HDF5 hyperslab reads for a chunked or filtered dataset), so its memory does not grow
with the corpus.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .sampler import Sampler, context_positions  # noqa: F401 - where callers find them
from .tokenizer import BYTES as TOKENIZER  # byte-level: token = byte value, vocabulary 256
from .tokenizer import Tokenizer, TokenizerError, byte_level
from .tokenizer import load as load_tokenizer

SPLITS = ("train", "val")


class DataError(ValueError):
    """A data file that cannot be used (missing, unreadable, not hpctrain's): one line that
    names the file and what is wrong. Raised deliberately, alike on every rank."""


def stdlib_documents(limit_bytes: int) -> list[tuple[str, bytes]]:
    """The embedded default corpus: Python's own standard-library sources, sorted by path
    (component by component), up to ``limit_bytes``. Found at run time, so nothing is
    downloaded; the walk stops once it has enough, so every rank pays milliseconds."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for rel, path in _sorted_sources(root, ""):
        if "site-packages" in rel or "test" in rel.split("/")[0]:
            continue
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        docs.append((rel, data))
        total += len(data)
        if total >= limit_bytes:
            break
    return docs


def _sorted_sources(top: str, rel: str):
    """(relative path, path) of every ``*.py`` under ``top`` in the order of
    ``sorted(Path(top).rglob("*.py"))`` (names sorted within each directory, depth first;
    symlinked directories not entered), lazily."""
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        r = f"{rel}/{e.name}" if rel else e.name
        if e.name.endswith(".py"):
            yield r, e.path
        try:
            is_dir = e.is_dir() and not e.is_symlink()
        except OSError:
            continue
        if is_dir and not (not rel and "test" in e.name) and e.name != "site-packages":
            yield from _sorted_sources(e.path, r)


def is_validation(doc: bytes, val_fraction: float) -> bool:
    """A document's split depends on its content only (stable across re-preparation)."""
    return _split_key(doc) < val_fraction * 1_000_000


def _split_key(doc: bytes) -> int:
    return int.from_bytes(hashlib.sha256(doc).digest()[:8], "little") % 1_000_000


def content_hash(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@dataclass
class TokenSource:
    """Tokens of one split (an array, or a lazily read :class:`TokenFile`), with the lineage
    of where they came from."""

    tokens: np.ndarray | TokenFile
    lineage: dict


class TokenFile:
    """One split's ``tokens`` dataset of a prepared file, read on demand: ``len()``, slices
    and :meth:`windows`. A contiguous dataset without filters is read with ``os.pread`` at
    its byte offset in the file (no HDF5 call, no memory map: pages a map touches would stay
    in the rank's resident memory, and over an epoch a rank touches most of them); any other
    layout through h5py hyperslabs. Safe to use from one reader thread at a time."""

    def __init__(self, path: str, split: str):
        self.path, self.split = path, split
        self._file = _open(path)
        d = _tokens_of(self._file, path, split)
        self.dtype, self._d = d.dtype, d
        self.length = int(d.shape[0])
        self.offset = _contiguous_offset(d)
        self._fd = None
        if self.offset is not None:
            self._fd = os.open(path, os.O_RDONLY)
            self._file.close()  # every read is a pread from here on

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, sl: slice) -> np.ndarray:
        lo, hi, step = sl.indices(self.length)
        if step != 1:
            raise IndexError("a TokenFile is read in contiguous slices")
        return self._read(lo, max(0, hi - lo))

    def _read(self, start: int, count: int) -> np.ndarray:
        if self._fd is None:
            return _read(self._d, self.path, slice(start, start + count))
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, self.offset + start * size)
        if len(data) != count * size:
            raise DataError(f"data.path={self.path}: {self.split}/tokens is shorter than its "
                            "header says (truncated?)")
        return np.frombuffer(data, dtype=self.dtype)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64: the ``length`` tokens from each start."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(np.asarray(starts, dtype=np.int64)):
            out[i] = self._read(int(s), length)
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        else:
            self._file.close()

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def _contiguous_offset(d) -> int | None:
    """Byte offset of ``d``'s elements in its file when they lie there as one plain run:
    contiguous layout, allocated, no filters, no external storage. None otherwise."""
    if d.chunks is not None or d.is_virtual or d.dtype.byteorder == ">":
        return None
    if d.id.get_create_plist().get_external_count() > 0:
        return None
    return d.id.get_offset()


def load_tokens(path: str, split: str = "train", corpus_mb: float = 2.0,
                val_fraction: float = 0.05, tokenizer: str = "") -> TokenSource:
    """The tokens of ``split`` from a prepared file, or from the embedded corpus when
    ``path`` is empty (byte-level, or tokenized with the tokenizer.json at ``tokenizer``).
    Every rank reads for itself (read-only, no collective); a file's tokens are read when a
    window is asked for (:class:`TokenFile`). A file that is missing, damaged or not
    hpctrain's raises :class:`DataError`."""
    if not path:
        limit = int(corpus_mb * 2**20)
        tok = _tokenizer(tokenizer)
        docs = _embedded_ids(limit, tok)
        train, val = (_cat([d for d, key in docs if (key < val_fraction * 1_000_000) == v],
                           tok) for v in (False, True))
        lineage = {"source": f"embedded: Python {sys.version.split()[0]} stdlib sources",
                   "tokenizer": tok.name, "content_hash": content_hash(train, val),
                   "documents": len(docs), "val_fraction": val_fraction}
        if tok.name != TOKENIZER:
            lineage.update(tokenizer_path=str(Path(tokenizer).resolve()),
                           tokenizer_hash=tok.hash, vocab_size=tok.vocab_size)
        return TokenSource(train if split == "train" else val, lineage)
    with _open(path) as f:
        _tokens_of(f, path, split)
        lineage = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    lineage["source"] = str(Path(path).resolve())
    return TokenSource(TokenFile(path, split), lineage)


def _tokenizer(path: str) -> Tokenizer:
    if not path:
        return byte_level()
    try:
        return load_tokenizer(path)
    except TokenizerError as e:
        raise DataError(f"data.tokenizer: {e}") from None


@functools.lru_cache(maxsize=2)
def _embedded_ids(limit_bytes: int, tok: Tokenizer) -> tuple[tuple[np.ndarray, int], ...]:
    """(token ids, split key) of each embedded document, tokenized once per process."""
    docs = [d for _, d in stdlib_documents(limit_bytes)]
    return tuple(zip(tok.encode(docs), (_split_key(d) for d in docs)))


def _cat(arrays: list[np.ndarray], tok: Tokenizer) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=tok.dtype)


@dataclass(frozen=True)
class DataSummary:
    """What a run must know about its data before it starts (:func:`summarize`)."""

    where: str  # "data.path=FILE" or "the embedded corpus (...)"
    tokenizer: str
    max_id: int  # the largest token id in either split; -1 when there are none
    tokens: dict = field(default_factory=dict)  # split -> number of tokens
    vocab_size: int = 0  # the tokenizer's vocabulary (0: not recorded)


def summarize(path: str, corpus_mb: float = 2.0, val_fraction: float = 0.05,
              tokenizer: str = "") -> DataSummary:
    """The tokenizer, largest token id and tokens per split of a run's data, from the file's
    attributes (a file prepared before ``max_token_id`` was recorded is read for it); the
    embedded corpus is read once per process. No collective. Raises :class:`DataError`."""
    if not path:
        return _embedded_summary(int(corpus_mb * 2**20), val_fraction, _tokenizer(tokenizer))
    with _open(path) as f:
        sets = {split: _tokens_of(f, path, split) for split in SPLITS}
        max_id = f.attrs.get("max_token_id")
        if max_id is None:  # prepared before it was recorded
            max_id = _max_id(*(_read(d, path) for d in sets.values()))
        elif not isinstance(max_id, (int, np.integer)):
            raise DataError(f"data.path={path}: attribute max_token_id={max_id!r} is not an "
                            "integer (not written by `hpctrain prepare`?)")
        tokenizer = f.attrs.get("tokenizer", "unrecorded")
        if isinstance(tokenizer, bytes):
            tokenizer = tokenizer.decode(errors="replace")
        vocab = f.attrs.get("vocab_size", 0)
        if not isinstance(vocab, (int, np.integer)):
            raise DataError(f"data.path={path}: attribute vocab_size={vocab!r} is not an "
                            "integer (not written by `hpctrain prepare`?)")
        return DataSummary(f"data.path={path}", str(tokenizer), int(max_id),
                           {k: int(d.shape[0]) for k, d in sets.items()}, int(vocab))


def fit_problems(s: DataSummary, vocab_size: int, seq_len: int, eval_every: int) -> list[str]:
    """Why a model with ``vocab_size`` rows cannot train on this data ([] when it can): every
    token id must have a row, and so must every id of the tokenizer (not checked for
    byte-level data, whose models may leave out bytes that never occur); each split used
    needs one sequence (seq_len + 2 tokens)."""
    out = []
    if s.max_id >= vocab_size:
        out.append(f"{s.where}: largest token id {s.max_id} (tokenizer {s.tokenizer}) needs "
                   f"model.vocab_size >= {s.max_id + 1}, got model.vocab_size={vocab_size}")
    elif s.tokenizer != TOKENIZER and s.vocab_size > vocab_size:
        out.append(f"{s.where}: tokenizer {s.tokenizer} has {s.vocab_size} ids, so "
                   f"model.vocab_size must be >= {s.vocab_size}, got "
                   f"model.vocab_size={vocab_size}")
    need = seq_len + 2
    if s.tokens["train"] < need:
        out.append(f"{s.where}: the train split has {s.tokens['train']} tokens, fewer than "
                   f"seq_len+2 = {need}")
    if eval_every and s.tokens["val"] < need:
        out.append(f"{s.where}: the validation split has {s.tokens['val']} tokens, fewer than "
                   f"seq_len+2 = {need}: raise data.val_fraction or data.corpus_mb, or set "
                   "train.eval_every = 0")
    return out


def _max_id(*arrays: np.ndarray) -> int:
    return max((int(a.max()) for a in arrays if a.size), default=-1)


@functools.lru_cache(maxsize=16)
def _embedded_summary(limit_bytes: int, val_fraction: float, tok: Tokenizer) -> DataSummary:
    counts = {"train": 0, "val": 0}
    for ids, key in _embedded_ids(limit_bytes, tok):
        counts["val" if key < val_fraction * 1_000_000 else "train"] += len(ids)
    top = max((_max_id(ids) for ids, _ in _embedded_ids(limit_bytes, tok)), default=-1)
    where = f"the embedded corpus (data.corpus_mb={limit_bytes / 2**20:g}" + (
        f", data.tokenizer={tok.name})" if tok.name != TOKENIZER else ")")
    return DataSummary(where, tok.name, top, counts, tok.vocab_size)


def _open(path: str):
    """The prepared file, open for reading; a missing or unreadable one is a DataError."""
    import h5py

    p = Path(path)
    if not p.is_file():
        why = "is not a file" if p.exists() else "does not exist"
        raise DataError(f"data.path={path} {why} (make one with "
                        "`hpctrain prepare FILES --out DATA.h5`)")
    try:
        return h5py.File(p, "r")
    except OSError as e:
        raise DataError(f"data.path={path} cannot be read as HDF5 (truncated, damaged or "
                        f"another format): {_line(e)}") from None


def _tokens_of(f, path: str, split: str):
    """The ``split/tokens`` dataset, checked to be what ``hpctrain prepare`` writes."""
    import h5py

    group = f.get(split, getclass=True)
    d = f[split].get("tokens") if group is h5py.Group else None
    if not isinstance(d, h5py.Dataset):
        raise DataError(f"data.path={path} is not an hpctrain data file: no {split}/tokens "
                        "dataset (make one with `hpctrain prepare FILES --out DATA.h5`)")
    if d.ndim != 1 or d.dtype.kind != "u":
        raise DataError(f"data.path={path}: {split}/tokens must be a 1-d array of unsigned "
                        f"integer token ids, got shape {d.shape} of {d.dtype}")
    return d


def _read(d, path: str, where=Ellipsis) -> np.ndarray:
    try:
        return d[where]
    except OSError as e:
        raise DataError(f"data.path={path}: {d.name} cannot be read (damaged?): "
                        f"{_line(e)}") from None


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())
