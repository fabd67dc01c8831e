"""Reading this rank's pieces of a checkpoint: the part of a load that moves the bytes.

A piece whose boxes are each one contiguous run of the global array (a row split, a whole
tensor, most ZeRO boxes) is read with one HDF5 hyperslab read, straight into the tensor's
memory where it can (:meth:`~.layout.Piece.direct`). A piece whose boxes are *strided* (a
column split read on another layout: one short run per row) is copied out of a read-only
memory map of the file instead, one NumPy slice per box (:func:`mapped_read`): one copy from
the page cache into the tensor, no read call per run (a hyperslab read of a strided
selection issues one ``MPI_File_read_at`` per run; the ways compared are in
docs/decisions.md and docs/checkpoints.md). The map needs the dataset stored
contiguously in the file itself, without filters (how hpctrain writes every dataset:
:func:`dataset_offset`); any other dataset is read through HDF5, and so is everything
where the file system refuses the map.

Independent reads (the default, ``checkpoint.collective_io = false``) therefore open the
file on each rank alone (``sec2``: no collective open); with collective I/O every rank
opens it over MPI-IO and takes part in every large dataset's collective read (an empty
selection where it needs nothing).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from .layout import Piece, transfer

MAP_KINDS = "biuf"  # plain numbers: their bytes in the file are the array's


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


def dataset_offset(dset) -> int | None:
    """Byte offset of ``dset``'s elements in its file when a memory map may read them: stored
    contiguously, allocated, no filters, no external file, a plain numeric dtype."""
    dt = dset.dtype
    if dset.chunks is not None or dset.is_virtual or dt.kind not in MAP_KINDS or dt.fields:
        return None
    if dset.id.get_create_plist().get_external_count() > 0:
        return None
    return dset.id.get_offset()


class Mapped:
    """A read-only memory map of one checkpoint file, opened at the first use; ``usable`` is
    False where the file system cannot map it (then HDF5 reads every piece)."""

    def __init__(self, path):
        self.path, self._map, self.usable = path, None, True

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        n = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=n, offset=offset).reshape(shape)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array still holds it (an exception's frames): GC
                pass
            self._map = None


@torch.no_grad()
def mapped_read(mapped: Mapped, offset: int, dset, piece: Piece) -> None:
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
    rank (then no dataset is memory-mapped)."""
    nbytes = 0
    mapped = Mapped(path)
    try:
        with torch.no_grad():
            for dpath in paths:
                piece, dset = pieces.get(dpath), f[dpath]
                size = dset.size * dset.dtype.itemsize
                nbytes += size  # the checkpoint's bytes: the same on every rank
                coll = collective and size >= collective_min_bytes
                offset = dataset_offset(dset) if not coll and strided(piece) else None
                if offset is not None and mapped.usable:
                    try:
                        mapped_read(mapped, offset, dset, piece)
                        continue
                    except OSError:  # no mmap here: HDF5 reads it (and all the rest)
                        mapped.usable = False
                into = piece.direct() if piece is not None else None
                buf = transfer(dset, piece, write=False, collective=coll, buf=into)
                if piece is not None and into is None:  # via a buffer
                    piece.scatter(buf)
    finally:
        mapped.close()
    return nbytes
