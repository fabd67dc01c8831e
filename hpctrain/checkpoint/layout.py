"""What each rank owns of a checkpoint, as hyperslabs of global datasets.

A :class:`Piece` is one local tensor (a parameter or one optimizer-state tensor) and the
list of *boxes* ``(start, count)`` it covers in the dataset's global shape, in the C order of
the global array. Two kinds exist:

* a **shard** of a parameter (tp rows/columns, ep experts, or the whole tensor): one box,
  :func:`hpctrain.model.stage.local_slice`; padding rows past the global extent are skipped.
* a **flat shard** (ZeRO): the optimizer holds elements ``[a, b)`` of the *flattened local*
  parameter (padded local shape). ``[a, b)`` is cut into at most ``2*ndim - 1`` boxes that
  are each contiguous in flat order (:func:`flat_boxes`), then clipped to the valid extent.

Extending to a new parallelism means describing its local tensors as boxes here; the file
format does not change. The optimizer protocol read here is generic:
``optimizer.local_state()`` (or, without it, ``optimizer.state``) ``[name] -> {key: tensor}``,
this rank's own tensors, no communication; a tensor is a flat shard when
``optimizer.flat_shard(name)`` returns ``(a, b)`` (ZeRO: a 1-D view of the shard holding the
local parameter's flattened elements [a, b)), otherwise it has the parameter's local shape
and is a shard like the parameter. Loading writes into these tensors in place.
``optimizer.writes_shard(name)`` (HSDP: copies of a shard in several shard groups) says
whether this rank writes its flat shard. ``optimizer.step_count`` is the global step
counter. ZeRO-3 shards the parameters too: ``optimizer.param_shard(name)`` is then a 1-D
view of the parameter's flat shard, written and read as a flat piece by every rank of the
group (no gathering, ever).

:func:`transfer` moves one piece between memory and an open h5py dataset with the HDF5
low-level API so that ranks holding nothing still take part in a collective transfer
(an empty selection), which h5py's high-level indexing would skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.stage import local_slice

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, count) in global coordinates
PLAIN_KINDS = "biuf"  # plain numbers: their bytes in the file are the array's


def file_dtype(t: torch.Tensor) -> np.dtype:
    """HDF5 has no bfloat16: 16-bit floats are stored widened to float32 (exact)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return np.dtype(np.float32)
    return torch.empty((), dtype=t.dtype).numpy().dtype


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, Box]]:
    """Cut flat range ``[a, b)`` of a C-ordered array of ``shape`` into boxes that are each
    contiguous in flat order: ``[(flat offset, (start, count))]`` in increasing order."""
    if not shape:
        return [(0, ((), ()))] if a < b else []
    inner = int(np.prod(shape[1:], dtype=np.int64))
    out = []
    while a < b:
        row, off = divmod(a, inner)
        if off == 0 and b - a >= inner:  # whole rows along dim 0
            n = (b - a) // inner
            out.append((a, ((row, *[0] * (len(shape) - 1)), (n, *shape[1:]))))
            a += n * inner
            continue
        stop = min(b, (row + 1) * inner)  # part of one row: recurse into shape[1:]
        for off2, (s, c) in flat_boxes(shape[1:], off, off + stop - a):
            out.append((row * inner + off2, ((row, *s), (1, *c))))
        a = stop
    return out


def box_runs(shape: tuple[int, ...], start, count) -> list[tuple[int, int]]:
    """The box ``(start, count)`` of a C-ordered array of ``shape`` as runs that are
    contiguous in the global flat order: ``[(flat offset, elements)]`` in the box's own C
    order (the order :meth:`Piece.gather` lays its bytes out)."""
    if not shape:
        return [(0, 1)]
    k = len(shape) - 1  # dims after k are whole: one run per index of dims [0, k)
    while k > 0 and count[k] == shape[k]:
        k -= 1
    strides = np.cumprod((1, *shape[:0:-1]), dtype=np.int64)[::-1]
    run = int(count[k]) * int(strides[k])
    offsets = np.zeros((1,), dtype=np.int64) + int(start[k]) * int(strides[k])
    for d in range(k - 1, -1, -1):  # outer dims, slowest first in the result
        rows = (np.arange(start[d], start[d] + count[d], dtype=np.int64) * int(strides[d]))
        offsets = (rows[:, None] + offsets[None, :]).reshape(-1)
    return [(int(o), run) for o in offsets]


@dataclass
class Piece:
    """One local tensor and where its elements live in the global dataset ``path``."""

    path: str
    global_shape: tuple[int, ...]
    dtype: np.dtype
    tensor: torch.Tensor
    writes: bool  # this rank is the one writer of these elements
    # (local view builder, global box): local(tensor) -> the tensor view for that box
    parts: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(box[1])) for _, box in self.parts) * self.dtype.itemsize

    def runs(self) -> list[tuple[int, int]]:
        """This rank's elements as global runs, in the order of :meth:`gather`."""
        return [r for _, (start, count) in self.parts
                for r in box_runs(self.global_shape, start, count)]

    def gather(self, copy: bool = False) -> np.ndarray:
        """This rank's elements, 1-D in the global C order of the boxes. ``copy``: memory
        of its own that later updates of the tensor cannot touch (pinned on a GPU)."""
        if not self.parts:
            return np.empty((0,), dtype=self.dtype)
        views = [view(self.tensor).reshape(-1) for view, _ in self.parts]
        flat = (views[0] if len(views) == 1 else torch.cat(views)).detach()
        if flat.dtype in (torch.bfloat16, torch.float16):
            flat = flat.float()
        if flat.is_cuda:  # one device-to-host copy; sync_device() waits for them all
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=copy)
            flat = host.copy_(flat, non_blocking=copy)
        elif copy and len(views) == 1 and flat.data_ptr() == views[0].data_ptr():
            flat = flat.clone()  # a view of the live tensor
        return np.ascontiguousarray(flat.numpy(), dtype=self.dtype)

    def direct(self) -> np.ndarray | None:
        """The tensor's own memory as the 1-D buffer :meth:`gather` would give (one whole,
        contiguous CPU tensor of the file's dtype), so that a load reads straight into it;
        None otherwise (a load then reads into a buffer and :meth:`scatter` copies)."""
        t = self.tensor
        if (len(self.parts) != 1 or t.is_cuda or not t.is_contiguous()
                or tuple(self.parts[0][1][1]) != tuple(t.shape)
                or t.dtype in (torch.bfloat16, torch.float16)):
            return None
        flat = t.detach().numpy().reshape(-1)
        view = self.parts[0][0](t)
        if flat.dtype != self.dtype or view.data_ptr() != t.data_ptr():
            return None
        return flat

    @torch.no_grad()
    def scatter(self, buf: np.ndarray) -> None:
        """Inverse of :meth:`gather`: copy a 1-D buffer into the local tensor."""
        src = torch.from_numpy(buf)
        pos = 0
        for view, (_, count) in self.parts:
            n = int(np.prod(count))
            dst = view(self.tensor)
            dst.copy_(src[pos:pos + n].view(dst.shape).to(self.tensor.dtype))
            pos += n


def _clip(start, count, extent):
    """Intersect box (start, count) with [0, extent) per dim; None when empty."""
    stop = [min(s + c, e) for s, c, e in zip(start, count, extent)]
    count = [max(0, p - s) for s, p in zip(start, stop)]
    return None if any(c == 0 for c in count) else tuple(count)


def shard_piece(path, tensor, meta, topo, writes) -> Piece:
    """A tensor of the parameter's local shape: one box (its tp/ep slice)."""
    index, extent = local_slice(meta, topo.tp_size, topo.tp_rank, topo.ep_size, topo.ep_rank)
    piece = Piece(path, tuple(meta.global_shape), file_dtype(tensor), tensor, writes)
    if all(n > 0 for n in extent):
        local = tuple(slice(0, n) for n in extent)
        whole = tuple(extent) == tuple(tensor.shape)  # no padding: the tensor itself (fast)
        piece.parts.append(((lambda t: t) if whole else (lambda t, s=local: t[s]),
                            (tuple(s.start for s in index), tuple(extent))))
    return piece


def flat_piece(path, tensor, meta, local_shape, a, b, topo, writes) -> Piece:
    """A ZeRO flat shard: ``tensor[:b-a]`` holds flat elements [a, b) of the local param."""
    index, extent = local_slice(meta, topo.tp_size, topo.tp_rank, topo.ep_size, topo.ep_rank)
    offset = [s.start for s in index]
    piece = Piece(path, tuple(meta.global_shape), file_dtype(tensor), tensor, writes)
    for flat0, (start, count) in flat_boxes(tuple(local_shape), a, b):
        clipped = _clip(start, count, extent)
        if clipped is None:
            continue
        sel = tuple(slice(0, c) for c in clipped)

        def view(t, f0=flat0 - a, shape=count, sel=sel):
            return t[f0:f0 + int(np.prod(shape))].view(shape)[sel]

        gstart = tuple(o + s for o, s in zip(offset, start))
        piece.parts.append((view, (gstart, clipped)))
    return piece


def pieces_of(named_params, optimizer, topo) -> list[Piece]:
    """Every piece this rank holds: parameters, then their optimizer state."""
    flat_shard = getattr(optimizer, "flat_shard", None)
    zero3 = getattr(optimizer, "zero3", False)
    local_state = getattr(optimizer, "local_state", None)
    state = local_state() if local_state is not None else optimizer.state
    writes_shard = getattr(optimizer, "writes_shard", lambda _name: True)  # HSDP: one copy
    out = []
    for i, (name, p) in enumerate(named_params):
        meta = p.hp
        group = topo.edpcp_comm if meta.expert_dim is not None else topo.dpcp_comm
        first_tp = meta.tp_dim is not None or topo.tp_rank == 0
        # replicas take turns (parameter i: replica i mod dp): the writing is spread evenly
        mine = group.rank == i % group.size
        if not isinstance(p, torch.nn.Parameter):  # state beside the parameters (MoE
            out.append(shard_piece(f"model/{name}", p, meta, topo, first_tp and mine))
            continue  # selection biases): never sharded by ZeRO, no optimizer state
        rng = flat_shard(name) if flat_shard is not None else None
        first = first_tp and writes_shard(name)  # of a flat shard
        if zero3:  # the parameter lives only in the shards: every rank writes its own
            pshard = optimizer.param_shard(name)
            a, b = rng or (0, 0)
            out.append(flat_piece(f"model/{name}", pshard if pshard is not None else
                                  p.new_empty(0), meta, p.shape, a, b, topo, first))
        else:
            out.append(shard_piece(f"model/{name}", p.detach(), meta, topo,
                                   first_tp and mine))
        for key, t in state.get(name, {}).items():
            path = f"optim/{name}/{key}"
            if rng is not None and t.dim() == 1 and t.numel() == rng[1] - rng[0]:
                # every rank of the group writes its own shard (tp-replicated: tp rank 0)
                out.append(flat_piece(path, t, meta, p.shape, *rng, topo, first))
            elif rng is None and tuple(t.shape) == tuple(p.shape):
                out.append(shard_piece(path, t, meta, topo, first_tp and mine))
            else:
                raise ValueError(f"cannot checkpoint optimizer state {path}: shape "
                                 f"{tuple(t.shape)} is neither the parameter's local shape "
                                 f"{tuple(p.shape)} nor its flat shard {rng}")
    return out


def uncovered(specs, counts) -> list[str]:
    """Datasets of ``specs`` ``[(path, shape, dtype)]`` whose elements written by all ranks
    together (``counts``, in ``specs`` order) are not their size: with one writer per element,
    a dataset is whole exactly when its count is its size."""
    return [f"{path} ({int(n)} of {int(np.prod(shape))} elements)"
            for (path, shape, _), n in zip(specs, counts) if int(n) != int(np.prod(shape))]


def misfits(f, pieces: dict) -> list[str]:
    """This rank's pieces that an open checkpoint ``f`` lacks or holds in another shape."""
    out = []
    for dpath, piece in pieces.items():
        if dpath not in f:
            out.append(f"the checkpoint has no dataset {dpath}")
        elif tuple(f[dpath].shape) != piece.global_shape:
            out.append(f"{dpath}: checkpoint shape {tuple(f[dpath].shape)} != model shape "
                       f"{piece.global_shape}")
    return out


def unknown_params(f, paths) -> list[str]:
    """Parameters in ``f`` that the model (``paths``: every rank's datasets) does not have."""
    return [f"this model has no parameter {p}"
            for p in sorted({f"model/{n}" for n in f["model"]} - set(paths))]


def byte_spans(runs, itemsize: int, base: int = 0):
    """For each run ``(flat element offset, elements)`` of a 1-D buffer that holds ``runs``
    one after another (:meth:`Piece.gather`'s order): ``(start, stop, at)``, its bytes
    ``[start, stop)`` in the buffer and their place ``at`` in a file whose dataset elements
    start at byte ``base``."""
    pos = 0
    for offset, n in runs:
        yield pos, pos + n * itemsize, base + offset * itemsize
        pos += n * itemsize


def dataset_offset(dset) -> int | None:
    """Byte offset of ``dset``'s elements in its file where they may be read or written
    without HDF5 (a memory map, ``pwrite``): stored contiguously, allocated, no filters, no
    external file, a plain numeric dtype. None otherwise."""
    dt = dset.dtype
    if dset.chunks is not None or dset.is_virtual or dt.kind not in PLAIN_KINDS or dt.fields:
        return None
    if dset.id.get_create_plist().get_external_count() > 0:
        return None
    return dset.id.get_offset()


def transfer(dset, piece: Piece | None, write: bool, collective: bool,
             buf: np.ndarray | None = None) -> np.ndarray | None:
    """Write ``piece`` into (or read it from) the h5py dataset ``dset``.

    ``piece`` None (or a non-writer on write) selects nothing: with ``collective`` True
    every rank of the file's communicator must call this for the same dataset in the same
    order (HDF5 collective I/O). ``buf``: on write, the piece's bytes already gathered
    (a snapshot); on read, where to read to (:meth:`Piece.direct`). Returns the 1-D buffer
    read."""
    from h5py import h5fd, h5p, h5s

    fspace = dset.id.get_space()
    fspace.select_none()
    active = piece is not None and piece.parts and (piece.writes or not write)
    n = 0
    if active:
        for i, (_, (start, count)) in enumerate(piece.parts):
            fspace.select_hyperslab(start, count, op=h5s.SELECT_OR if i else h5s.SELECT_SET)
            n += int(np.prod(count))
    if write and active:
        buf = buf if buf is not None else piece.gather()
    elif write:
        buf = np.empty((0,), dtype=dset.dtype)
    elif buf is None or buf.size != n:  # native byte order: HDF5 converts (torch needs it)
        buf = np.empty((n,), dtype=dset.dtype.newbyteorder("="))
    if n == 0 and not collective:
        return buf
    mspace = h5s.create_simple((max(n, 1),))
    if n == 0:
        mspace.select_none()
        buf_io = np.empty((1,), dtype=dset.dtype)
    else:
        buf_io = buf
    dxpl = h5p.create(h5p.DATASET_XFER)
    if collective:
        dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    if write:
        dset.id.write(mspace, fspace, buf_io, dxpl=dxpl)
    else:
        dset.id.read(mspace, fspace, buf_io, dxpl=dxpl)
    return buf
