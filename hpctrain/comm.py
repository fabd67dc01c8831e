"""The only module that hands buffers to MPI.

Every collective and point-to-point transfer of the trainer goes through a :class:`Group`
(one per topology axis). Tensors are handed over zero-copy: CPU torch tensors as numpy views
with mpi4py's upper-case buffer methods, CUDA tensors through ``hpctrain/gpu.py`` (CuPy
via DLPack, or host staging). bfloat16/float16 travel as raw 16-bit words for data
movement and are reduced in float32.

Every operation is recorded (op, axis, peer, bytes, posted, completed) in a
:class:`Recorder`: per-axis totals feed the step-time breakdown, the ring of the last
operations is the flight recorder the watchdog dumps when a rank is stuck.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

PROC_NULL = MPI.PROC_NULL
_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class OpRecord:
    op: str
    axis: str
    peer: int  # rank in the axis communicator; -1 for collectives
    nbytes: int
    posted: float
    completed: float = 0.0  # 0 while in flight

    @property
    def state(self) -> str:
        return "done" if self.completed else "in-flight"


@dataclass
class Recorder:
    """Per-process record of communication: exposed seconds and bytes per axis, and a ring
    of the last operations (the flight recorder)."""

    ring_size: int = 256
    exposed_s: collections.Counter = field(default_factory=collections.Counter)
    bytes: collections.Counter = field(default_factory=collections.Counter)
    calls: collections.Counter = field(default_factory=collections.Counter)
    ring: collections.deque = field(default_factory=collections.deque)
    listeners: list = field(default_factory=list)  # callables(record), e.g. the tracer

    def post(self, op: str, axis: str, peer: int, nbytes: int) -> OpRecord:
        rec = OpRecord(op, axis, peer, nbytes, time.perf_counter())
        self.ring.append(rec)
        while len(self.ring) > self.ring_size:
            self.ring.popleft()
        self.bytes[axis] += nbytes
        self.calls[axis] += 1
        return rec

    def complete(self, rec: OpRecord, waited_s: float) -> None:
        rec.completed = time.perf_counter()
        self.exposed_s[rec.axis] += waited_s
        for fn in self.listeners:
            fn(rec)

    def take(self) -> tuple[dict, dict]:
        """(exposed seconds, bytes) per axis since the last call; resets the counters."""
        out = dict(self.exposed_s), dict(self.bytes)
        self.exposed_s.clear()
        self.bytes.clear()
        self.calls.clear()
        return out


RECORDER = Recorder()


class _Buffers:
    """Turns tensors into MPI buffers for one operation and remembers the copy-backs that
    host staging of device tensors needs (``done()`` runs them once MPI has finished)."""

    def __init__(self):
        self._finish = []

    def __call__(self, t: torch.Tensor, write: bool = False):
        if not t.is_contiguous():
            raise ValueError("MPI buffers must be contiguous tensors")
        if t.dtype in _LOW_PRECISION:  # 16-bit floats move as raw 16-bit words
            t = t.view(torch.int16)
        if t.is_cuda or _stand_in_active():
            from . import gpu

            buf, finish = gpu.mpi_buffer(t, write)
            if finish is not None:
                self._finish.append(finish)
            return buf
        return t.detach().numpy()

    def done(self) -> None:
        for fn in self._finish:
            fn()
        self._finish.clear()


def _stand_in_active() -> bool:
    gpu = sys.modules.get("hpctrain.gpu")  # never import CUDA code on CPU-only runs
    return gpu is not None and gpu.BACKEND.name == "stand-in"


def _buffer(t: torch.Tensor):
    """Zero-copy MPI buffer of a contiguous host tensor (read-only uses)."""
    return _Buffers()(t)


class Handle:
    """A posted nonblocking operation. ``wait()`` completes it (idempotent) and runs the
    finaliser (e.g. copy-back of a float32-staged reduction)."""

    def __init__(self, request, rec: OpRecord, finalise=None, keep=None):
        self._req, self._rec, self._finalise, self._keep = request, rec, finalise, keep
        self.done = False

    def test(self) -> bool:
        """Drive MPI progress; True when complete (then finalised)."""
        if not self.done and self._req.Test():
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        self._req.Wait()
        self._finish(time.perf_counter() - t0)

    def _finish(self, waited: float) -> None:
        self.done = True
        if self._finalise is not None:
            self._finalise()
        RECORDER.complete(self._rec, waited)
        self._keep = None


class _DoneRequest:
    """A request that is already complete (size-1 groups)."""

    def Test(self) -> bool:  # noqa: N802 - mirrors MPI.Request
        return True

    def Wait(self) -> None:  # noqa: N802
        return None


def wait_all(handles) -> None:
    for h in handles:
        h.wait()


class Group:
    """One communicator with the collectives the trainer needs.

    All methods are collective over this group unless named ``isend``/``irecv``. Methods
    ending in ``_`` work in place. ``axis`` names the group in records and messages.
    """

    def __init__(self, mpi_comm, axis: str):
        self.mpi = mpi_comm
        self.axis = axis
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()

    def __repr__(self) -> str:
        return f"Group({self.axis}, rank {self.rank}/{self.size})"

    # -- helpers -----------------------------------------------------------------------
    def _run(self, op: str, nbytes: int, fn, peer: int = -1):
        rec = RECORDER.post(op, self.axis, peer, nbytes)
        t0 = time.perf_counter()
        out = fn()
        RECORDER.complete(rec, time.perf_counter() - t0)
        return out

    # -- reductions --------------------------------------------------------------------
    def allreduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce; 16-bit floats are reduced in float32."""
        if self.size == 1:
            return t
        if t.dtype in _LOW_PRECISION:
            staged = t.float()
            self.allreduce_(staged, op)
            t.copy_(staged)
            return t
        bufs = _Buffers()
        buf = bufs(t, write=True)
        self._run("allreduce", t.nbytes, lambda: self.mpi.Allreduce(MPI.IN_PLACE, buf, _OPS[op]))
        bufs.done()
        return t

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Handle:
        """Nonblocking in-place all-reduce; the tensor is valid after ``wait()``."""
        rec = RECORDER.post("iallreduce", self.axis, -1, t.nbytes)
        bufs = _Buffers()
        if t.dtype in _LOW_PRECISION:
            staged = t.float()
            req = self.mpi.Iallreduce(MPI.IN_PLACE, bufs(staged, write=True), _OPS[op])

            def finalise():
                bufs.done()
                t.copy_(staged)

            return Handle(req, rec, finalise=finalise, keep=staged)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, bufs(t, write=True), _OPS[op])
        return Handle(req, rec, finalise=bufs.done, keep=t)

    def allreduce(self, value: float, op: str = "sum") -> float:
        """All-reduce of one Python number (float64)."""
        buf = np.array([value], dtype=np.float64)
        if self.size > 1:
            self._run("allreduce", 8, lambda: self.mpi.Allreduce(MPI.IN_PLACE, buf, _OPS[op]))
        return float(buf[0])

    def allreduce_array(self, arr: np.ndarray, op: str = "sum") -> np.ndarray:
        """All-reduce of a small numpy array (statistics, counters); returns a new array."""
        out = np.array(arr, copy=True)
        if self.size > 1:
            self._run("allreduce", out.nbytes,
                      lambda: self.mpi.Allreduce(MPI.IN_PLACE, out, _OPS[op]))
        return out

    def reduce_scatter(self, t_in: torch.Tensor, t_out: torch.Tensor) -> torch.Tensor:
        """Sum ``t_in`` (``size`` equal blocks along dim 0) and keep block ``rank`` in t_out."""
        if self.size == 1:
            return t_out.copy_(t_in)
        if t_in.dtype in _LOW_PRECISION:
            out32 = torch.empty_like(t_out, dtype=torch.float32)
            self.reduce_scatter(t_in.float(), out32)
            return t_out.copy_(out32)
        bufs = _Buffers()
        sb, rb = bufs(t_in), bufs(t_out, write=True)
        self._run("reduce_scatter", t_in.nbytes,
                  lambda: self.mpi.Reduce_scatter_block(sb, rb, MPI.SUM))
        bufs.done()
        return t_out

    def ireduce_scatter(self, t_in: torch.Tensor, t_out: torch.Tensor) -> Handle:
        """Nonblocking :meth:`reduce_scatter`; ``t_out`` is valid after ``wait()``. 16-bit
        inputs are reduced in float32 (``t_out`` may be float32 to keep that precision)."""
        rec = RECORDER.post("ireduce_scatter", self.axis, -1, t_in.nbytes)
        src = t_in.float() if t_in.dtype in _LOW_PRECISION else t_in
        dst = t_out.float() if t_out.dtype in _LOW_PRECISION or src.dtype != t_out.dtype \
            else t_out
        bufs = _Buffers()

        def finalise():
            bufs.done()
            if dst is not t_out:
                t_out.copy_(dst)

        if self.size == 1:
            dst.copy_(src)
            return Handle(_DoneRequest(), rec, finalise=finalise)
        req = self.mpi.Ireduce_scatter_block(bufs(src), bufs(dst, write=True), MPI.SUM)
        return Handle(req, rec, finalise=finalise, keep=(src, dst))

    # -- data movement -----------------------------------------------------------------
    def allgather(self, t_in: torch.Tensor, t_out: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t_in`` along dim 0 into ``t_out`` (rank order)."""
        if self.size == 1:
            return t_out.copy_(t_in)
        bufs = _Buffers()
        sb, rb = bufs(t_in), bufs(t_out, write=True)
        self._run("allgather", t_out.nbytes, lambda: self.mpi.Allgather(sb, rb))
        bufs.done()
        return t_out

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.size > 1:
            bufs = _Buffers()
            buf = bufs(t, write=True)
            self._run("bcast", t.nbytes, lambda: self.mpi.Bcast(buf, root=root))
            bufs.done()
        return t

    def bcast_obj(self, obj, root: int = 0):
        """Broadcast a small picklable control object (never model data)."""
        return self.mpi.bcast(obj, root=root) if self.size > 1 else obj

    def allgather_obj(self, obj) -> list:
        """Gather a small control object (strings, numbers) from every rank."""
        return self.mpi.allgather(obj) if self.size > 1 else [obj]

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        """Exchange one integer per peer (the sizes before an ``alltoallv``)."""
        recv = np.empty_like(counts)
        if self.size == 1:
            recv[...] = counts
            return recv
        self._run("alltoall", counts.nbytes, lambda: self.mpi.Alltoall(counts, recv))
        return recv

    def _alltoallv_args(self, bufs, send, send_counts, recv, recv_counts):
        row = int(np.prod(send.shape[1:])) if send.dim() > 1 else 1
        sc = np.asarray(send_counts, dtype=np.int64) * row
        rc = np.asarray(recv_counts, dtype=np.int64) * row
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        return [bufs(send), (sc, sd)], [bufs(recv, write=True), (rc, rd)]

    def alltoallv(self, send, send_counts, recv, recv_counts) -> torch.Tensor:
        """Rows ``send[off_j : off_j + send_counts[j]]`` go to rank j; rows from rank j land
        at ``recv[off_j : ...]``. Counts are in rows (dim 0)."""
        bufs = _Buffers()
        s, r = self._alltoallv_args(bufs, send, send_counts, recv, recv_counts)
        self._run("alltoallv", send.nbytes, lambda: self.mpi.Alltoallv(s, r))
        bufs.done()
        return recv

    def ialltoallv(self, send, send_counts, recv, recv_counts) -> Handle:
        """Nonblocking :meth:`alltoallv`; ``recv`` is valid after ``wait()``."""
        bufs = _Buffers()
        s, r = self._alltoallv_args(bufs, send, send_counts, recv, recv_counts)
        rec = RECORDER.post("ialltoallv", self.axis, -1, send.nbytes)
        return Handle(self.mpi.Ialltoallv(s, r), rec, finalise=bufs.done,
                      keep=(send, recv, s, r))

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        rec = RECORDER.post("isend", self.axis, dest, t.nbytes)
        buf = _Buffers()(t)
        return Handle(self.mpi.Isend(buf, dest=dest, tag=tag), rec, keep=(t, buf))

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Handle:
        rec = RECORDER.post("irecv", self.axis, source, t.nbytes)
        bufs = _Buffers()
        buf = bufs(t, write=True)
        return Handle(self.mpi.Irecv(buf, source=source, tag=tag), rec, finalise=bufs.done,
                      keep=(t, buf))

    def barrier(self) -> None:
        self._run("barrier", 0, self.mpi.Barrier)


# -- communicator construction (used by topology.py) -----------------------------------
def world() -> Group:
    return Group(MPI.COMM_WORLD, "world")


def cartesian(world_group: Group, dims, key: int | None = None) -> Group:
    """A non-periodic Cartesian communicator. ``key`` (the same choice on every rank: all
    None or all ints) reorders ranks for a placement; collective over the world."""
    base = world_group.mpi
    if key is not None:
        base = base.Split(0, key)
    return Group(base.Create_cart(list(dims), periods=[False] * len(dims), reorder=False),
                 "grid")


def sub(cart: Group, remain, axis: str) -> Group:
    return Group(cart.mpi.Sub(list(remain)), axis)


def shift(cart: Group, direction: int) -> tuple[int, int]:
    """(prev, next) along one dimension, as ranks of that dimension's sub-communicator."""
    src, dst = cart.mpi.Shift(direction, 1)
    coords = cart.mpi.Get_coords
    prev = PROC_NULL if src == PROC_NULL else coords(src)[direction]
    nxt = PROC_NULL if dst == PROC_NULL else coords(dst)[direction]
    return prev, nxt


def node_local(cart: Group, axis: str = "node") -> Group:
    """The ranks of ``cart`` (any group) that share memory with this one, in its rank order.
    Collective over ``cart``."""
    return Group(cart.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=cart.rank), axis)


def split(group: Group, color: int, key: int, axis: str) -> Group:
    """Ranks of ``group`` with the same ``color`` form one new group, ordered by ``key``.
    Collective over ``group``."""
    return Group(group.mpi.Split(color, key), axis)


def processor_name() -> str:
    return MPI.Get_processor_name()


def abort(code: int = 1) -> None:
    """End every rank of the job (used on an exception or by the watchdog)."""
    MPI.COMM_WORLD.Abort(code)


def wtime() -> float:
    return MPI.Wtime()


def finalize() -> None:
    """Finalise MPI (collective over the world) before ``os._exit`` with a status code."""
    if not MPI.Is_finalized():
        MPI.Finalize()


def mpi_info(hints: dict):
    """An ``MPI.Info`` holding string hints (MPI-IO: striping_factor, cb_nodes, ...), for
    libraries that open files over a communicator (parallel HDF5); ``MPI.INFO_NULL`` when
    there are none."""
    if not hints:
        return MPI.INFO_NULL
    info = MPI.Info.Create()
    for key, value in hints.items():
        info.Set(str(key), str(value))
    return info
