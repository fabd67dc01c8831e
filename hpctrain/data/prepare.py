"""``hpctrain prepare``: documents -> one HDF5 token file, on any number of ranks.

Every rank lists the same documents (text files, the embedded corpus, or a tokenized
``nanogpt``/``megatron`` corpus, :mod:`hpctrain.data.corpora`) and takes a contiguous block of
them, balanced by size; it tokenizes its block (:mod:`hpctrain.data.tokenizer`) and picks each
document's split by a hash of its content (``data.is_validation``: the text's bytes, or the
token ids as little-endian uint32), never by rank or position. One all-gather of the counts
gives every rank its offsets; the file is created collectively (h5py's ``mpio`` driver on the
world communicator, like checkpoints) and each rank writes its slices. Rank 0 then hashes
the tokens (``content_hash``: sha256 of train then val tokens) and renames ``OUT.tmp`` to
``OUT`` once an all-gather has shown that every rank wrote its slices (any rank's failure:
``OUT.tmp`` is removed, ``OUT`` untouched, every rank raises :class:`DataError` naming the
failing rank). Without parallel HDF5 (or with ``HPCTRAIN_PREPARE_SERIAL=1``) the ranks write
in turn. Every dataset's storage is allocated when it is created (``ALLOC_TIME_EARLY``), so
where a dataset lies in the file does not depend on which rank writes first: the file is
the same, byte for byte, for any number of ranks (more ranks than documents included) and
either writer.

A directory contributes its regular files, in sorted order, except hidden ones (a name
starting with ``.``: ``.git/`` is not entered) and binary ones (:func:`binary`, decided by
the rank that reads the file); both are counted (``skipped_hidden``, ``skipped_binary``).

Layout (docs/data.md)::

    /train/tokens, /val/tokens           uint8 (bytes), uint16 (vocab <= 65536) or uint32
    /train/doc_starts, /val/doc_starts   int64: where each document starts in its split
    /tokenizer_json                      uint8: the tokenizer.json text (absent for bytes)
    attrs: tokenizer, tokenizer_hash, vocab_size, max_token_id, content_hash, documents,
           train_documents, val_documents, val_fraction, source_format, sources, created_by,
           eot (``--from nanogpt``), skipped_hidden and skipped_binary (text)
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
    hidden: int = 0  # hidden files and directories left out of the listing
    binary: bool = False  # read binary files too (else each is left out and counted)


# How a file that is not text starts: ELF, gzip, zip, bzip2, xz, zstd, 7-Zip, PNG, JPEG,
# Mach-O (both byte orders); any NUL byte in the first SNIFF bytes also marks a binary file.
SIGNATURES = (b"\x7fELF", b"\x1f\x8b", b"PK\x03\x04", b"BZh", b"\xfd7zXZ\x00",
              b"\x28\xb5\x2f\xfd", b"7z\xbc\xaf\x27\x1c", b"\x89PNG", b"\xff\xd8\xff",
              b"\xcf\xfa\xed\xfe", b"\xfe\xed\xfa\xcf")
SNIFF = 8192


def binary(doc: bytes) -> bool:
    """Whether a file's bytes are not text: a NUL byte near the start, or the signature of an
    executable, archive or image."""
    return b"\x00" in doc[:SNIFF] or doc.startswith(SIGNATURES)


def text_source(paths: list[str], hidden: bool = False, binary: bool = False) -> Source:
    """Files, or every regular file below a directory that is not hidden (unless
    ``hidden``), in sorted order (a file named in ``paths`` is read even when its name starts
    with a dot); ``binary``: binary files are documents too."""
    files, left_out = [], 0
    for s in paths:
        p = Path(s)
        if p.is_dir():
            found, n = _listing(p, hidden)
            files, left_out = files + found, left_out + n
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
                  np.array([f.stat().st_size for f in files], dtype=np.int64), load,
                  hidden=left_out, binary=binary)


def _listing(top: Path, keep_hidden: bool) -> tuple[list[Path], int]:
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
class Block:
    """One rank's documents, tokenized and split (ids still in the source's dtype)."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    binary: int = 0  # files left out as not text

    def counts(self) -> tuple[int, int, int, int, int, int]:
        ids = self.train + self.val
        top = max((int(a.max()) for a in ids if a.size), default=-1)
        return (sum(a.size for a in self.train), sum(a.size for a in self.val),
                len(self.train), len(self.val), top, self.binary)


def encode_block(src: Source, tok: Tokenizer | None, lo: int, hi: int,
                 val_fraction: float) -> Block:
    """Documents lo..hi-1 of ``src`` as token ids, split by the hash of their content."""
    out = Block([], [])
    for a in range(lo, hi, BATCH):
        docs = [src.load(i) for i in range(a, min(hi, a + BATCH))]
        if src.form == "text":
            text = [d for d in docs if src.binary or not binary(d)]
            out.binary += len(docs) - len(text)
            ids, keys = (tok.encode(text) if text else []), text
        else:
            ids, keys = docs, [d.astype("<u4").tobytes() for d in docs]
        for d, key in zip(ids, keys):
            (out.val if is_validation(key, val_fraction) else out.train).append(d)
    return out


def prepare(src: Source, tok: Tokenizer | None, out: str, val_fraction: float = 0.05,
            group=None) -> dict:
    """Write ``out`` from ``src`` on every rank of ``group`` (a ``comm.Group``; None: this
    process alone, serial HDF5). Collective; returns the file's attributes on every rank.
    Anything wrong on any rank (a source, the tokenizer, ``out``, a write) raises
    :class:`DataError` alike on every rank, naming the rank, and nothing is left at ``out``
    (a file already there is untouched). Every rank's outcome is all-gathered after each
    phase in which ranks act alone (reading and tokenizing; writing its slices), so a rank
    that fails there still takes part in the next collective."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    lo, hi = blocks(src.sizes, size)[rank]
    block, why = None, _attempt(lambda: Path(out).parent.mkdir(parents=True, exist_ok=True),
                                f"cannot write {out}")  # every rank: exist_ok races fine
    if why is None:
        try:
            block = encode_block(src, tok, lo, hi, val_fraction)
        except (DataError, FormatError, TokenizerError) as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any error must reach the all-gather
            why = f"{type(e).__name__}: {e}"
    every = _gather(group, (why, None if block is None else block.counts()))
    _raise_failed([w for w, _ in every])
    counts = np.array([c for _, c in every], dtype=np.int64)  # per rank: nt nv dt dv top bin
    attrs = _attrs(src, tok, counts, val_fraction)
    if src.form == "text" and not attrs["documents"]:
        raise DataError(f"no text documents in {', '.join(src.names[:3])}: "
                        f"{attrs['skipped_binary']} binary file(s) skipped")
    dtype = (tok.dtype if tok is not None and src.form == "text"
             else token_dtype(max(attrs["vocab_size"], attrs["max_token_id"] + 1)))
    tmp = str(Path(out).with_name(Path(out).name + ".tmp"))
    why = _write(group, tmp, block, dtype, counts, counts[:rank].sum(axis=0), attrs, tok)
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


def _attempt(action: Callable[[], None], what: str) -> str | None:
    """None when ``action()`` succeeds, else ``what`` and the error on one line (any error:
    this rank must still reach the next collective to say so)."""
    try:
        action()
    except Exception as e:  # noqa: BLE001
        line = _oneline(e) if isinstance(e, OSError) else f"{type(e).__name__}: {_oneline(e)}"
        return f"{what}: {line}" if what else line
    return None


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
    if src.form == "text":
        attrs["skipped_hidden"], attrs["skipped_binary"] = src.hidden, int(counts[:, 5].sum())
    return attrs


def _write(group, tmp: str, block: Block, dtype, counts, before, attrs, tok) -> str | None:
    """Write ``tmp``; returns this rank's error (None: its part is written). Parallel HDF5:
    the collective open (its failure is every rank's), the datasets and attributes
    (collective, in memory, the same on every rank), then each rank's slices (an error is
    kept, so that the rank still takes part in the collective close). Without parallel
    HDF5 (an h5py built without MPI, or ``SERIAL_ENV`` set): rank 0 creates the file and
    the ranks write in turn."""
    import h5py

    args = (block, dtype, counts.sum(axis=0), before, tok)
    if group is None or group.size == 1 and not _mpio():
        return _attempt(lambda: _serial(tmp, "w", True, attrs, *args), "")
    if not _mpio():
        why = None
        first = group.rank == 0
        for r in range(group.size):
            if r == group.rank:
                why = _attempt(lambda: _serial(tmp, "w" if first else "r+", first, attrs,
                                               *args), "")
            group.barrier()
        return why
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=group.mpi)
    except OSError as e:
        return _oneline(e)
    _create(f, attrs, *args)  # not caught: an error here ends the job (no close to wait in)
    why = _attempt(lambda: _slices(f, group.rank == 0, *args), "")
    closed = _attempt(f.close, "")  # collective
    return why or closed


def _oneline(e: Exception) -> str:
    return " ".join(str(e).split())


def _serial(tmp: str, mode: str, create: bool, attrs: dict, *args) -> None:
    import h5py

    with h5py.File(tmp, mode) as f:
        if create:
            _create(f, attrs, *args)
        _slices(f, create, *args)


SERIAL_ENV = "HPCTRAIN_PREPARE_SERIAL"  # force the serial writer (tests, file systems)


def _mpio() -> bool:
    import h5py

    return bool(h5py.get_config().mpi) and os.environ.get(SERIAL_ENV, "") in ("", "0")


def _create(f, attrs: dict, block: Block, dtype, tot, before, tok) -> None:
    """The datasets, their storage allocated now (so that the file's layout does not depend
    on which rank writes first), and the attributes; collective under mpio."""
    from h5py import h5d, h5p

    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)  # every byte is written by one rank
    for k, split in enumerate(("train", "val")):
        f.create_dataset(f"{split}/tokens", shape=(int(tot[k]),), dtype=dtype, dcpl=dcpl)
        f.create_dataset(f"{split}/doc_starts", shape=(int(tot[2 + k]),), dtype=np.int64,
                         dcpl=dcpl)
    if tok is not None and tok.json:
        f.create_dataset("tokenizer_json", shape=(len(tok.json.encode()),), dtype=np.uint8,
                         dcpl=dcpl)
    f.attrs.update(attrs)


def _slices(f, first: bool, block: Block, dtype, tot, before, tok) -> None:
    """This rank's token slices and document starts; ``first``: the tokenizer text too."""
    for k, split in enumerate(("train", "val")):
        docs = block.train if k == 0 else block.val
        if docs:
            lens = np.array([d.size for d in docs], dtype=np.int64)
            at, first_doc = int(before[k]), int(before[2 + k])
            f[f"{split}/tokens"][at:at + int(lens.sum())] = np.concatenate(docs).astype(dtype)
            f[f"{split}/doc_starts"][first_doc:first_doc + len(docs)] = \
                at + np.cumsum(lens) - lens
    if first and tok is not None and tok.json:
        f["tokenizer_json"][...] = np.frombuffer(tok.json.encode(), dtype=np.uint8)


def _finish(tmp: str, out: str, attrs: dict) -> str | None:
    """Rank 0, after the collective close: the content hash, then the atomic rename."""
    import h5py

    def commit() -> None:
        with h5py.File(tmp, "r+") as f:
            attrs["content_hash"] = tokens_hash(f)
            f.attrs["content_hash"] = attrs["content_hash"]
        os.replace(tmp, out)

    return _attempt(commit, f"cannot write {out}")


def tokens_hash(f, chunk: int = 1 << 24) -> str:
    """sha256 of the train then the val tokens (data.content_hash, read in chunks)."""
    h = hashlib.sha256()
    for split in ("train", "val"):
        d = f[f"{split}/tokens"]
        for a in range(0, d.shape[0], chunk):
            h.update(np.ascontiguousarray(d[a:a + chunk]).tobytes())
    return h.hexdigest()
