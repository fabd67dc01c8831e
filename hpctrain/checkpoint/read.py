"""Reading this rank's pieces of a checkpoint: the part of a load that moves the bytes.

Where a dataset is stored contiguously in the file itself, without filters, in the host's
byte order (how hpctrain writes every dataset: :func:`~.layout.dataset_offset`), its bytes
are read without HDF5 (:class:`FileBytes`):

* a piece whose boxes are each one contiguous run of the global array (a row split, a
  whole tensor, most ZeRO boxes) with ``preadv``, straight into the tensor's memory where
  it can (:meth:`~.layout.Piece.direct`): an HDF5 hyperslab read of the same run took
  about 3x as long;
* a piece whose boxes are *strided* (a column split read on another layout: one short run
  per row) is copied out of a read-only memory map, one NumPy slice per box
  (:func:`mapped_read`): one copy from the page cache into the tensor, no read call per run
  (the ways compared are in docs/decisions.md and docs/checkpoints.md).

Any other dataset (chunked, compressed, another byte order: a file written by other tools)
is read through HDF5, and so is everything where the file system refuses the map.

Independent reads (the default, ``checkpoint.collective_io = false``) therefore open the
file on each rank alone (``sec2``: no collective open); with collective I/O every rank
opens it over MPI-IO and takes part in every large dataset's collective read (an empty
selection where it needs nothing).
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from .layout import Piece, byte_spans, dataset_offset, transfer


def contiguous(shape, start, count) -> bool:
    """Whether box ``(start, count)`` of a C-ordered array of ``shape`` is one run of its
    flat order: every dim after the first that is cut must be whole, and every dim before
    that first cut one must have count 1."""
    k = len(shape) - 1
    while k > 0 and count[k] == shape[k]:
        k -= 1
    return all(c == 1 for c in count[:k])


def strided(piece: Piece | None) -> bool:
    """A piece with a box that is not one contiguous run of the global array."""
    return piece is not None and any(not contiguous(piece.global_shape, s, c)
                                     for _, (s, c) in piece.parts)


class FileBytes:
    """One checkpoint file's bytes read without HDF5, opened at the first use: ``preadv``
    into memory, or a read-only memory map; ``usable`` is False where the file system
    cannot map it (then HDF5 reads every strided piece)."""

    def __init__(self, path):
        self.path, self._map, self._fd, self.usable = path, None, None, True

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        n = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=n, offset=offset).reshape(shape)

    def read_runs(self, base: int, buf: np.ndarray, runs) -> None:
        """Fill the 1-D ``buf`` with ``runs`` ``[(flat element offset, elements)]`` of the
        dataset whose elements start at byte ``base`` (the inverse of write.write_runs)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        raw = memoryview(buf).cast("B")
        for pos, end, at in byte_spans(runs, buf.dtype.itemsize, base):
            while pos < end:
                got = os.preadv(self._fd, [raw[pos:end]], at)
                if got == 0:
                    raise OSError(f"{self.path} ends inside a dataset (at byte {at})")
                pos, at = pos + got, at + got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array still holds it (an exception's frames): GC
                pass
            self._map = None


@torch.no_grad()
def mapped_read(mapped: FileBytes, offset: int, dset, piece: Piece) -> None:
    """Copy each box of ``piece`` from the mapped dataset into its view of the tensor."""
    src = mapped.array(offset, piece.global_shape, dset.dtype)
    for view, (start, count) in piece.parts:
        box = src[tuple(slice(s, s + c) for s, c in zip(start, count))]
        dst = view(piece.tensor)
        if not dst.is_cuda and dst.dtype == _torch_dtype(box.dtype):
            np.copyto(dst.detach().numpy(), box)  # one strided copy, page cache -> tensor
        else:
            native = box.dtype.newbyteorder("=")
            dst.copy_(torch.from_numpy(np.ascontiguousarray(box, dtype=native)))


def _torch_dtype(dt: np.dtype):
    if not dt.isnative:
        return None
    try:
        return torch.from_numpy(np.empty(0, dtype=dt)).dtype
    except TypeError:
        return None


def read_pieces(f, path, paths, pieces: dict, collective_min_bytes: int,
                collective: bool) -> int:
    """Read every dataset of ``paths`` (every rank's, the same list everywhere) that this rank
    holds a piece of; returns the checkpoint's bytes. ``collective``: ``f`` is open over
    MPI-IO, and datasets of at least ``collective_min_bytes`` are read collectively by every
    rank (HDF5 reads them all)."""
    nbytes = 0
    raw = FileBytes(path)
    try:
        with torch.no_grad():
            for dpath in paths:
                piece, dset = pieces.get(dpath), f[dpath]
                size = dset.size * dset.dtype.itemsize
                nbytes += size  # the checkpoint's bytes: the same on every rank
                coll = collective and size >= collective_min_bytes
                if not coll and piece is not None and _read_raw(raw, dset, piece):
                    continue
                into = piece.direct() if piece is not None else None
                buf = transfer(dset, piece, write=False, collective=coll, buf=into)
                if piece is not None and into is None:  # via a buffer
                    piece.scatter(buf)
    finally:
        raw.close()
    return nbytes


def _read_raw(raw: FileBytes, dset, piece: Piece) -> bool:
    """Read ``piece`` without HDF5 where the dataset allows it (module docstring); False
    where HDF5 must read it."""
    offset = dataset_offset(dset) if piece.parts else None
    if offset is None:
        return False
    if strided(piece):
        if not raw.usable:
            return False
        try:
            mapped_read(raw, offset, dset, piece)
            return True
        except OSError:  # no mmap here: HDF5 reads it (and all the rest)
            raw.usable = False
            return False
    if not dset.dtype.isnative and dset.dtype.itemsize > 1:
        return False  # HDF5 converts the byte order
    buf = piece.direct()
    direct = buf is not None and buf.dtype == dset.dtype
    if not direct:  # via a buffer of the file's dtype
        buf = np.empty((sum(int(np.prod(c)) for _, (_, c) in piece.parts),), dset.dtype)
    raw.read_runs(offset, buf, piece.runs())
    if not direct:
        piece.scatter(buf)
    return True
