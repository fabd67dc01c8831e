"""``hpctrain prepare``: documents -> one HDF5 token file, on any number of ranks.

Every rank lists the same documents (text files, the embedded corpus, or a tokenized
``nanogpt``/``megatron`` corpus, :mod:`hpctrain.data.corpora`) and takes a contiguous block of
them, balanced by size; it tokenizes its block (:mod:`hpctrain.data.tokenizer`) and picks each
document's split by a hash of its content (``data.is_validation``: the text's bytes, or the
token ids as little-endian uint32), never by rank or position. One all-gather of the counts
gives every rank its offsets; the file is created collectively (h5py's ``mpio`` driver on the
world communicator, like checkpoints) and each rank writes its slices. Rank 0 then hashes
the tokens (``content_hash``: sha256 of train then val tokens) and renames ``OUT.tmp`` to
``OUT``. The file is the same, byte for byte, for any number of ranks. Without parallel
HDF5 (or with ``HPCTRAIN_PREPARE_SERIAL=1``) the ranks write in turn: the same datasets and
attributes (the bytes of that writer also agree across rank counts, not with mpio's).

Layout (docs/data.md)::

    /train/tokens, /val/tokens           uint8 (bytes), uint16 (vocab <= 65536) or uint32
    /train/doc_starts, /val/doc_starts   int64: where each document starts in its split
    /tokenizer_json                      uint8: the tokenizer.json text (absent for bytes)
    attrs: tokenizer, tokenizer_hash, vocab_size, max_token_id, content_hash, documents,
           train_documents, val_documents, val_fraction, source_format, sources, created_by
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpora import FormatError, read
from .dataset import DataError, is_validation, stdlib_documents
from .tokenizer import Tokenizer, TokenizerError, token_dtype

BATCH = 256  # documents encoded per call of the tokenizer


@dataclass
class Source:
    """The documents to prepare: ``load(i)`` is document i (bytes of text, or token ids)."""

    form: str  # "text", "nanogpt" or "megatron"
    names: list[str]
    sizes: np.ndarray  # bytes or tokens per document (for balancing the blocks)
    load: Callable[[int], object]
    eot: int | None = None


def text_source(paths: list[str]) -> Source:
    """Files, or every regular file below a directory, in sorted order."""
    files = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            files += [f for f in sorted(p.rglob("*")) if f.is_file()]
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"{s} is neither a file nor a directory")
    if not files:
        raise DataError(f"no input documents in {', '.join(paths)}")

    def load(i: int) -> bytes:
        try:
            return files[i].read_bytes()
        except OSError as e:
            raise DataError(f"{files[i]} cannot be read: {e.strerror or e}") from None

    return Source("text", [str(f) for f in files],
                  np.array([f.stat().st_size for f in files], dtype=np.int64), load)


def embedded_source(corpus_mb: float) -> Source:
    """The embedded corpus (Python's standard-library sources, data.stdlib_documents)."""
    docs = stdlib_documents(int(corpus_mb * 2**20))
    return Source("text", [f"embedded:{name}" for name, _ in docs],
                  np.array([len(d) for _, d in docs], dtype=np.int64), lambda i: docs[i][1])


def token_source(kind: str, path: str, eot: int) -> Source:
    try:
        corpus = read(kind, path, eot)
    except FormatError as e:
        raise DataError(str(e)) from None
    if not len(corpus):
        raise DataError(f"{path}: no tokens")
    return Source(kind, [f"{kind}:{path}"], corpus.sizes, corpus.document,
                  eot if kind == "nanogpt" else None)


def blocks(sizes: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [lo, hi) ranges of documents with about equal total size."""
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    cuts = [0] + [int(np.searchsorted(ends, total * k / parts, side="right"))
                  for k in range(1, parts)] + [len(sizes)]
    cuts = list(np.maximum.accumulate(cuts))
    return [(cuts[k], cuts[k + 1]) for k in range(parts)]


@dataclass
class Block:
    """One rank's documents, tokenized and split (ids still in the source's dtype)."""

    train: list[np.ndarray]
    val: list[np.ndarray]

    def counts(self) -> tuple[int, int, int, int, int]:
        ids = self.train + self.val
        top = max((int(a.max()) for a in ids if a.size), default=-1)
        return (sum(a.size for a in self.train), sum(a.size for a in self.val),
                len(self.train), len(self.val), top)


def encode_block(src: Source, tok: Tokenizer | None, lo: int, hi: int,
                 val_fraction: float) -> Block:
    """Documents lo..hi-1 of ``src`` as token ids, split by the hash of their content."""
    out = Block([], [])
    for a in range(lo, hi, BATCH):
        docs = [src.load(i) for i in range(a, min(hi, a + BATCH))]
        if src.form == "text":
            ids, keys = tok.encode(docs), docs
        else:
            ids, keys = docs, [d.astype("<u4").tobytes() for d in docs]
        for d, key in zip(ids, keys):
            (out.val if is_validation(key, val_fraction) else out.train).append(d)
    return out


def prepare(src: Source, tok: Tokenizer | None, out: str, val_fraction: float = 0.05,
            group=None) -> dict:
    """Write ``out`` from ``src`` on every rank of ``group`` (a ``comm.Group``; None: this
    process alone, serial HDF5). Collective; returns the file's attributes on every rank.
    Anything wrong (a source, the tokenizer, ``out``) raises :class:`DataError` alike on
    every rank, and nothing is left at ``out``."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    lo, hi = blocks(src.sizes, size)[rank]
    try:
        block, why = encode_block(src, tok, lo, hi, val_fraction), None
    except (DataError, FormatError, TokenizerError) as e:
        block, why = None, str(e)
    every = _gather(group, (why, None if block is None else block.counts()))
    if any(w for w, _ in every):
        raise DataError(next(w for w, _ in every if w))
    counts = np.array([c for _, c in every], dtype=np.int64)  # per rank: nt, nv, dt, dv, top
    attrs = _attrs(src, tok, counts, val_fraction)
    dtype = (tok.dtype if tok is not None and src.form == "text"
             else token_dtype(max(attrs["vocab_size"], attrs["max_token_id"] + 1)))
    before = counts[:rank].sum(axis=0)
    tmp = str(Path(out).with_name(Path(out).name + ".tmp"))
    why = None
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # every rank: exist_ok races fine
        _write(group, tmp, block, dtype, counts, before, attrs, tok)
    except (OSError, ValueError) as e:
        why = f"cannot write {out}: {' '.join(str(e).split())}"
    if rank == 0 and why is None:
        why = _finish(tmp, out, attrs)
    if group is not None:
        why, attrs["content_hash"] = group.bcast_obj((why, attrs.get("content_hash")))
    if why:
        if rank == 0 and Path(tmp).is_file():
            Path(tmp).unlink()
        raise DataError(why)
    return attrs


def _gather(group, obj) -> list:
    return group.allgather_obj(obj) if group is not None else [obj]


def _attrs(src: Source, tok: Tokenizer | None, counts: np.ndarray, val_fraction: float) -> dict:
    top = int(counts[:, 4].max())
    if tok is not None:
        name, digest, vocab = tok.name, tok.hash, tok.vocab_size
    else:  # tokens without their tokenizer: the vocabulary the ids need
        name, digest, vocab = f"{src.form} token ids", "", max(top, src.eot or 0) + 1
    attrs = {"tokenizer": name, "tokenizer_hash": digest, "vocab_size": int(vocab),
             "max_token_id": top, "documents": int(counts[:, 2:4].sum()),
             "train_documents": int(counts[:, 2].sum()),
             "val_documents": int(counts[:, 3].sum()), "val_fraction": float(val_fraction),
             "source_format": src.form, "sources": "\n".join(src.names)[:60000],
             "created_by": "hpctrain prepare"}
    if src.eot is not None:
        attrs["eot"] = int(src.eot)
    return attrs


def _write(group, tmp: str, block: Block, dtype, counts, before, attrs, tok) -> None:
    """Create the file collectively (all ranks, identical arguments), then each rank writes
    its slices. Without parallel HDF5 (an h5py built without MPI, or ``SERIAL_ENV`` set):
    rank 0 creates the file and the ranks write in turn (same contents, slower)."""
    import h5py

    args = (block, dtype, counts.sum(axis=0), before, attrs, tok)
    if group is None or group.size == 1 and not _mpio():
        with h5py.File(tmp, "w") as f:
            _fill(f, True, True, *args)
    elif _mpio():
        with h5py.File(tmp, "w", driver="mpio", comm=group.mpi) as f:
            _fill(f, True, group.rank == 0, *args)
    else:
        why = None
        for r in range(group.size):
            if r == group.rank and why is None:
                try:
                    with h5py.File(tmp, "w" if r == 0 else "r+") as f:
                        _fill(f, r == 0, r == 0, *args)
                except (OSError, ValueError) as e:
                    why = e
            group.barrier()
        failed = [w for w in group.allgather_obj(None if why is None else str(why)) if w]
        if failed:
            raise OSError(failed[0])


SERIAL_ENV = "HPCTRAIN_PREPARE_SERIAL"  # force the serial writer (tests, file systems)


def _mpio() -> bool:
    import h5py

    return bool(h5py.get_config().mpi) and os.environ.get(SERIAL_ENV, "") in ("", "0")


def _fill(f, create: bool, first: bool, block: Block, dtype, tot, before, attrs, tok) -> None:
    """``create``: the datasets and attributes (collective under mpio); then this rank's
    token slices and document starts; ``first``: the tokenizer text too."""
    for k, split in enumerate(("train", "val")):
        if create:
            f.create_dataset(f"{split}/tokens", shape=(int(tot[k]),), dtype=dtype)
            f.create_dataset(f"{split}/doc_starts", shape=(int(tot[2 + k]),), dtype=np.int64)
        docs = block.train if k == 0 else block.val
        if docs:
            lens = np.array([d.size for d in docs], dtype=np.int64)
            at, first_doc = int(before[k]), int(before[2 + k])
            f[f"{split}/tokens"][at:at + int(lens.sum())] = np.concatenate(docs).astype(dtype)
            f[f"{split}/doc_starts"][first_doc:first_doc + len(docs)] = \
                at + np.cumsum(lens) - lens
    if tok is not None and tok.json:
        raw = np.frombuffer(tok.json.encode(), dtype=np.uint8)
        if create:
            f.create_dataset("tokenizer_json", shape=raw.shape, dtype=np.uint8)
        if first:
            f["tokenizer_json"][...] = raw
    if create:
        f.attrs.update(attrs)


def _finish(tmp: str, out: str, attrs: dict) -> str | None:
    """Rank 0, after the collective close: the content hash, then the atomic rename."""
    import h5py

    try:
        with h5py.File(tmp, "r+") as f:
            attrs["content_hash"] = _tokens_hash(f)
            f.attrs["content_hash"] = attrs["content_hash"]
        os.replace(tmp, out)
    except OSError as e:
        return f"cannot write {out}: {' '.join(str(e).split())}"
    return None


def _tokens_hash(f, chunk: int = 1 << 24) -> str:
    """sha256 of the train then the val tokens (data.content_hash, read in chunks)."""
    h = hashlib.sha256()
    for split in ("train", "val"):
        d = f[f"{split}/tokens"]
        for a in range(0, d.shape[0], chunk):
            h.update(np.ascontiguousarray(d[a:a + chunk]).tobytes())
    return h.hexdigest()
