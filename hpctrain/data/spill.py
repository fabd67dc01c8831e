"""How ``hpctrain prepare`` writes: each rank streams its tokens to rank-local spill files
(:class:`Spill`) while it reads, then, once the counts are all-gathered, the ranks create the
HDF5 file together and copy their spill files into their slices in chunks
(:data:`COPY` bytes at a time). A rank thus never holds more than one batch of documents
and one chunk of tokens or lengths, whatever the size of its share.

Every dataset's storage is allocated when it is created (``ALLOC_TIME_EARLY``), so where a
dataset lies in the file does not depend on which rank writes first: the file is the same,
byte for byte, for any number of ranks and either writer (parallel HDF5, or the ranks in turn
without it or with ``HPCTRAIN_PREPARE_SERIAL=1``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

COPY = 1 << 22  # bytes of tokens (or document lengths) copied from a spill file at a time
SERIAL_ENV = "HPCTRAIN_PREPARE_SERIAL"  # force the serial writer (tests, file systems)
SPLITS = ("train", "val")


class Spill:
    """One rank's documents on disk: per split, the token ids (``dtype``) and each
    document's length (int64), appended as they are tokenized."""

    def __init__(self, stem: str, dtype):
        self.dtype = np.dtype(dtype)
        self.paths = {(s, k): f"{stem}.{s}.{k}" for s in SPLITS for k in ("tokens", "lengths")}
        self.files = {}
        for key, path in self.paths.items():
            self.files[key] = open(path, "wb")  # noqa: SIM115 - closed by close()

    def add(self, split: str, ids: np.ndarray) -> None:
        self.files[split, "tokens"].write(np.ascontiguousarray(ids, self.dtype).tobytes())
        self.files[split, "lengths"].write(np.int64(ids.size).tobytes())

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def remove(self) -> None:
        self.close()
        for path in self.paths.values():
            Path(path).unlink(missing_ok=True)

    def chunks(self, split: str, kind: str) -> object:
        dtype = self.dtype if kind == "tokens" else np.dtype(np.int64)
        with open(self.paths[split, kind], "rb") as f:
            while (a := np.fromfile(f, dtype=dtype, count=COPY // dtype.itemsize)).size:
                yield a


def write(group, tmp: str, spill: Spill, dtype, tot, before, attrs: dict, tok) -> str | None:
    """Write ``tmp``; returns this rank's error (None: its part is written). Parallel HDF5:
    the collective open (its failure is every rank's), the datasets and attributes
    (collective, in memory, the same on every rank), then each rank's slices (an error is
    kept, so that the rank still takes part in the collective close). Without parallel
    HDF5 (an h5py built without MPI, or ``SERIAL_ENV`` set): rank 0 creates the file and
    the ranks write in turn."""
    import h5py

    args = (spill, dtype, tot, before, tok)
    if group is None or group.size == 1 and not _mpio():
        return attempt(lambda: _serial(tmp, "w", True, attrs, *args), "")
    if not _mpio():
        why = None
        first = group.rank == 0
        for r in range(group.size):
            if r == group.rank:
                why = attempt(lambda: _serial(tmp, "w" if first else "r+", first, attrs,
                                              *args), "")
            group.barrier()
        return why
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=group.mpi)
    except OSError as e:
        return oneline(e)
    _create(f, attrs, *args)  # not caught: an error here ends the job (no close to wait in)
    why = attempt(lambda: _slices(f, group.rank == 0, *args), "")
    closed = attempt(f.close, "")  # collective
    return why or closed


def attempt(action: Callable[[], None], what: str) -> str | None:
    """None when ``action()`` succeeds, else ``what`` and the error on one line (any error:
    this rank must still reach the next collective to say so)."""
    try:
        action()
    except Exception as e:  # noqa: BLE001
        line = oneline(e) if isinstance(e, OSError) else f"{type(e).__name__}: {oneline(e)}"
        return f"{what}: {line}" if what else line
    return None


def oneline(e: Exception) -> str:
    return " ".join(str(e).split())


def _serial(tmp: str, mode: str, create: bool, attrs: dict, *args) -> None:
    import h5py

    with h5py.File(tmp, mode) as f:
        if create:
            _create(f, attrs, *args)
        _slices(f, create, *args)


def _mpio() -> bool:
    import h5py

    return bool(h5py.get_config().mpi) and os.environ.get(SERIAL_ENV, "") in ("", "0")


def _create(f, attrs: dict, spill: Spill, dtype, tot, before, tok) -> None:
    """The datasets, their storage allocated now (so that the file's layout does not depend
    on which rank writes first), and the attributes; collective under mpio."""
    from h5py import h5d, h5p

    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)  # every byte is written by one rank
    for k, split in enumerate(SPLITS):
        f.create_dataset(f"{split}/tokens", shape=(int(tot[k]),), dtype=dtype, dcpl=dcpl)
        f.create_dataset(f"{split}/doc_starts", shape=(int(tot[2 + k]),), dtype=np.int64,
                         dcpl=dcpl)
    if tok is not None and tok.json:
        f.create_dataset("tokenizer_json", shape=(len(tok.json.encode()),), dtype=np.uint8,
                         dcpl=dcpl)
    f.attrs.update(attrs)


def _slices(f, first: bool, spill: Spill, dtype, tot, before, tok) -> None:
    """This rank's token slices and document starts, copied from its spill files a chunk at
    a time; ``first``: the tokenizer text too."""
    for k, split in enumerate(SPLITS):
        at = int(before[k])
        for ids in spill.chunks(split, "tokens"):
            f[f"{split}/tokens"][at:at + ids.size] = ids.astype(dtype, copy=False)
            at += ids.size
        at, doc = int(before[k]), int(before[2 + k])
        for lens in spill.chunks(split, "lengths"):
            ends = at + np.cumsum(lens)
            f[f"{split}/doc_starts"][doc:doc + lens.size] = ends - lens
            at, doc = int(ends[-1]), doc + lens.size
    if first and tok is not None and tok.json:
        f["tokenizer_json"][...] = np.frombuffer(tok.json.encode(), dtype=np.uint8)


def tokens_hash(f, chunk: int = 1 << 22) -> str:
    """sha256 of the train then the val tokens (data.content_hash, read ``chunk`` bytes at a
    time)."""
    h = hashlib.sha256()
    for split in SPLITS:
        d = f[f"{split}/tokens"]
        step = max(1, chunk // d.dtype.itemsize)
        for a in range(0, d.shape[0], step):
            h.update(np.ascontiguousarray(d[a:a + step]).tobytes())
    return h.hexdigest()
