"""Token data: reading prepared HDF5 files, an embedded corpus (byte-level, or tokenized with
``data.tokenizer``), and a sampler whose global batch for step ``s`` is the same whatever the
layout. Writing the files is :mod:`hpctrain.data.prepare` (``hpctrain prepare``).

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

Sampling (invariant 3): step ``s`` draws ``global_batch_size`` start offsets from a
generator seeded by ``(seed, s)``; sequence ``i`` of the global batch is
``tokens[start_i : start_i + T + 1]``. Global microbatch ``j`` is sequences
``[j*dp*mbs, (j+1)*dp*mbs)``; dp rank ``r`` takes ``mbs`` consecutive sequences of it. With
context parallelism every cp rank of a dp rank takes the same sequences and keeps its own
positions of them (:func:`context_positions`: chunks ``i`` and ``2cp-1-i`` of ``2cp``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .tokenizer import BYTES as TOKENIZER  # byte-level: token = byte value, vocabulary 256
from .tokenizer import Tokenizer, TokenizerError, byte_level
from .tokenizer import load as load_tokenizer

if TYPE_CHECKING:
    import torch

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
    """Tokens of one split in memory, with the lineage of where they came from."""

    tokens: np.ndarray
    lineage: dict


def load_tokens(path: str, split: str = "train", corpus_mb: float = 2.0,
                val_fraction: float = 0.05, tokenizer: str = "") -> TokenSource:
    """The tokens of ``split`` from a prepared file, or from the embedded corpus when
    ``path`` is empty (byte-level, or tokenized with the tokenizer.json at ``tokenizer``).
    Every rank reads for itself (read-only, no collective). A file that is missing, damaged
    or not hpctrain's raises :class:`DataError`."""
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
        tokens = _read(_tokens_of(f, path, split), path)
        lineage = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    lineage["source"] = str(Path(path).resolve())
    return TokenSource(tokens, lineage)


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


def _read(d, path: str) -> np.ndarray:
    try:
        return d[...]
    except OSError as e:
        raise DataError(f"data.path={path}: {d.name} cannot be read (damaged?): "
                        f"{_line(e)}") from None


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())


def context_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """The positions of a sequence that cp rank ``cp_rank`` holds: chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks (causal load balancing: every
    rank gets one early and one late chunk, so the same attention work), in increasing
    order. All positions when ``cp_size`` is 1. Matches ``parallel.ring_attention.segments``."""
    if cp_size == 1:
        return np.arange(seq_len)
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return np.concatenate([np.arange(cp_rank * c, (cp_rank + 1) * c),
                           np.arange(late * c, (late + 1) * c)])


class Sampler:
    """Deterministic, layout-independent batches.

    ``global_batch(step)`` -> (x, y) int64 tensors of shape (G, T); ``local(step)`` -> the
    list of this dp rank's microbatches [(x_j, y_j)], each (mbs, T), or with context
    parallelism (mbs, T/cp): this cp rank's positions (:func:`context_positions`). With
    ``documents`` (``data.segments.Documents``) each microbatch is (x_j, y_j, d_j): d_j its
    windows' document ids and positions, (mbs, 2, T) (all T, with cp too).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, micro_batch: int,
                 dp_size: int, dp_rank: int, seed: int, device=None, cp_size: int = 1,
                 cp_rank: int = 0, documents=None):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len+2 = "
                             f"{seq_len + 2}")
        self.tokens, self.T, self.G = tokens, seq_len, global_batch
        self.mbs, self.dp, self.r, self.seed = micro_batch, dp_size, dp_rank, seed
        self.microbatches = global_batch // (dp_size * micro_batch)
        self.device = device  # batches are moved there (the GPU of this rank)
        self.columns = None if cp_size == 1 else context_positions(seq_len, cp_size, cp_rank)
        self.documents = documents  # window starts -> (B, 2, T) ids and positions, or None

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.T - 1, size=self.G)

    def _rows(self, starts: np.ndarray, columns=None) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # not at module level: `hpctrain prepare` runs without it

        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        seq = torch.from_numpy(self.tokens[idx].astype(np.int64))
        if columns is not None:  # this cp rank's positions (inputs, then their targets)
            cols = torch.from_numpy(np.concatenate([columns, columns + 1]))
            seq = seq[:, cols]
        if self.device is not None:
            seq = seq.to(self.device)
        if columns is None:
            return seq[:, :-1], seq[:, 1:]
        return seq[:, :len(columns)], seq[:, len(columns):]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.starts(step))

    def local(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        starts = self.starts(step)
        out = []
        for j in range(self.microbatches):
            lo = j * self.dp * self.mbs + self.r * self.mbs
            out.append(self._rows(starts[lo:lo + self.mbs], self.columns))
            if self.documents is not None:
                d = self.documents(starts[lo:lo + self.mbs])
                out[-1] += (d if self.device is None else d.to(self.device),)
        return out
