"""The only place that hands buffers to MPI: :class:`Group` and its nonblocking handles.

Every collective and point-to-point transfer of the trainer goes through a :class:`Group`
(one per topology axis). Tensors are handed over zero-copy: CPU torch tensors as numpy views
with mpi4py's upper-case buffer methods, CUDA tensors through ``comm/gpu.py`` (CuPy
via DLPack, or host staging). bfloat16/float16 travel as raw 16-bit words for data
movement and are reduced in float32, except with op ``sum16`` (bfloat16 summed as 16-bit
words on the wire: ``sum16.py``).

Every operation is recorded (op, axis, peer, bytes, posted, completed) in the group's
:class:`Recorder` (``records.py``), one per run, shared by all groups of a topology.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from . import sum16
from .records import OpRecord, Recorder

if TYPE_CHECKING:
    import torch

PROC_NULL = MPI.PROC_NULL
_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _op(name: str) -> MPI.Op:
    """The MPI op called ``name``. ``sum16`` sums bfloat16 as 16-bit words (``sum16.py``,
    made on first use, so that importing hpctrain starts no MPI); the others reduce 16-bit
    floats staged in float32."""
    return sum16.op() if name == "sum16" else _OPS[name]


# Under Open MPI, a blocking all-reduce, reduce-scatter or all-gather of a host buffer from
# this size on is posted and waited for: libnbc's all-reduce (reduce-scatter + all-gather,
# the algorithm the launch and the CLI set) ran 1.2-3x faster than MPI_Allreduce's own
# choice from 128 KiB to 14 MiB, within a node and across two; its reduce-scatter 1.3-1.7x
# and all-gather 1.1-1.7x faster at 1-14 MiB (docs/decisions.md). Device buffers stay
# blocking (libnbc does not reduce in device memory).
POSTED_FROM = 128 << 10


@functools.cache
def _libnbc() -> bool:
    return MPI.Get_library_version().startswith("Open MPI")


def _posted(t: torch.Tensor) -> bool:
    return t.nbytes >= POSTED_FROM and t.device.type == "cpu" and _libnbc()


class _Buffers:
    """Turns tensors into MPI buffers for one operation and remembers the copy-backs that
    host staging of device tensors needs (``done()`` runs them once MPI has finished)."""

    def __init__(self):
        self._finish = []

    def __call__(self, t: torch.Tensor, write: bool = False, raw: bool = False):
        """``raw``: host memory as bytes (data movement only), without a numpy view, which
        would pin the tensor's storage size (ZeRO-3 frees and re-grows gathered buffers)."""
        if not t.is_contiguous():
            raise ValueError("MPI buffers must be contiguous tensors")
        if raw and not t.is_cuda and not _stand_in_active():
            return [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), MPI.BYTE]
        if _low(t):  # 16-bit floats move as raw 16-bit words
            import torch  # loaded already: t is a tensor

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


def _low(t) -> bool:
    """A 16-bit float tensor (bfloat16, float16): reduced in float32, moved as 16-bit words.
    Asked of the tensor, so importing comm does not import torch (a config refused before
    any collective costs no torch start-up)."""
    return t.is_floating_point() and t.element_size() == 2


def _stand_in_active() -> bool:
    gpu = sys.modules.get("hpctrain.comm.gpu")  # never import CUDA code on CPU-only runs
    return gpu is not None and gpu.BACKEND.name == "stand-in"


def _buffer(t: torch.Tensor):
    """Zero-copy MPI buffer of a contiguous host tensor (read-only uses)."""
    return _Buffers()(t)


class Handle:
    """A posted nonblocking operation. ``wait()`` completes it (idempotent) and runs the
    finaliser (e.g. copy-back of a float32-staged reduction)."""

    def __init__(self, recorder: Recorder, request, rec: OpRecord, finalise=None, keep=None):
        self._recorder = recorder
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

    def wait_yielding(self, spin_s: float = 50e-6, max_sleep_s: float = 200e-6) -> None:
        """Complete like :meth:`wait`, but after ``spin_s`` of polling (``Test``, which
        drives MPI progress) sleep between polls, doubling from 10 us to ``max_sleep_s``:
        a rank waiting in the pipeline bubble gives its core to the ranks that compute
        (``MPI_Wait`` spins; on an oversubscribed node the spinning rank is then descheduled
        when its message arrives)."""
        if self.done:
            return
        t0 = time.perf_counter()
        req, nap = self._req, 10e-6
        while not req.Test():
            if time.perf_counter() - t0 > spin_s:
                time.sleep(nap)
                nap = min(2 * nap, max_sleep_s)
        self._finish(time.perf_counter() - t0)

    def _finish(self, waited: float) -> None:
        self.done = True
        if self._finalise is not None:
            self._finalise()
        self._recorder.complete(self._rec, waited)
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
    ending in ``_`` work in place. ``axis`` names the group in records and messages;
    ``recorder`` receives every operation (a new one when not given).
    """

    def __init__(self, mpi_comm, axis: str, recorder: Recorder | None = None):
        self.mpi = mpi_comm
        self.axis = axis
        self.recorder = recorder if recorder is not None else Recorder()
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        self._tag_ub: int | None = None

    def __repr__(self) -> str:
        return f"Group({self.axis}, rank {self.rank}/{self.size})"

    @property
    def tag_ub(self) -> int:
        """The largest point-to-point tag this communicator accepts (``MPI_TAG_UB``; the
        standard guarantees at least 32767). The attribute is predefined on
        ``MPI_COMM_WORLD``; a derived communicator that does not carry it has the world's."""
        if self._tag_ub is None:
            ub = self.mpi.Get_attr(MPI.TAG_UB)
            if ub is None:
                ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
            self._tag_ub = int(ub) if ub is not None else 32767
        return self._tag_ub

    # -- helpers -----------------------------------------------------------------------
    def _run(self, op: str, nbytes: int, fn, peer: int = -1):
        rec = self.recorder.post(op, self.axis, peer, nbytes)
        t0 = time.perf_counter()
        out = fn()
        self.recorder.complete(rec, time.perf_counter() - t0)
        return out

    def _blocking(self, op: str, t: torch.Tensor, nbytes: int, call, post):
        """``call()``, or ``post().Wait()`` where ``t`` is posted (:func:`_posted`)."""
        return self._run(op, nbytes, (lambda: post().Wait()) if _posted(t) else call)

    # -- reductions --------------------------------------------------------------------
    def allreduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce; 16-bit floats are reduced in float32 (``sum16``: bfloat16 on
        the wire)."""
        if self.size == 1:
            return t
        if _low(t) and op != "sum16":
            staged = t.float()
            self.allreduce_(staged, op)
            t.copy_(staged)
            return t
        bufs = _Buffers()
        buf = bufs(t, write=True)
        self._blocking("allreduce", t, t.nbytes,
                       lambda: self.mpi.Allreduce(MPI.IN_PLACE, buf, _op(op)),
                       lambda: self.mpi.Iallreduce(MPI.IN_PLACE, buf, _op(op)))
        bufs.done()
        return t

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Handle:
        """Nonblocking in-place all-reduce; the tensor is valid after ``wait()``."""
        rec = self.recorder.post("iallreduce", self.axis, -1, t.nbytes)
        bufs = _Buffers()
        if _low(t) and op != "sum16":
            staged = t.float()
            req = self.mpi.Iallreduce(MPI.IN_PLACE, bufs(staged, write=True), _op(op))

            def finalise():
                bufs.done()
                t.copy_(staged)

            return Handle(self.recorder, req, rec, finalise=finalise, keep=staged)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, bufs(t, write=True), _op(op))
        return Handle(self.recorder, req, rec, finalise=bufs.done, keep=t)

    def allreduce(self, value: float, op: str = "sum") -> float:
        """All-reduce of one Python number (float64)."""
        buf = np.array([value], dtype=np.float64)
        if self.size > 1:
            self._run("allreduce", 8, lambda: self.mpi.Allreduce(MPI.IN_PLACE, buf, _op(op)))
        return float(buf[0])

    def allreduce_array(self, arr: np.ndarray, op: str = "sum") -> np.ndarray:
        """All-reduce of a small numpy array (statistics, counters); returns a new array."""
        out = np.array(arr, copy=True)
        if self.size > 1:
            self._run("allreduce", out.nbytes,
                      lambda: self.mpi.Allreduce(MPI.IN_PLACE, out, _op(op)))
        return out

    def reduce_scatter(self, t_in: torch.Tensor, t_out: torch.Tensor,
                       op: str = "sum") -> torch.Tensor:
        """Sum ``t_in`` (``size`` equal blocks along dim 0) and keep block ``rank`` in t_out
        (``sum16``: bfloat16 in and out, on the wire too)."""
        if self.size == 1:
            return t_out.copy_(t_in)
        if _low(t_in) and op != "sum16":
            out32 = t_out.new_empty(t_out.shape, dtype=t_in.float().dtype)
            self.reduce_scatter(t_in.float(), out32)
            return t_out.copy_(out32)
        bufs = _Buffers()
        sb, rb = bufs(t_in), bufs(t_out, write=True)
        self._blocking("reduce_scatter", t_in, t_in.nbytes,
                       lambda: self.mpi.Reduce_scatter_block(sb, rb, _op(op)),
                       lambda: self.mpi.Ireduce_scatter_block(sb, rb, _op(op)))
        bufs.done()
        return t_out

    def ireduce_scatter(self, t_in: torch.Tensor, t_out: torch.Tensor,
                        op: str = "sum") -> Handle:
        """Nonblocking :meth:`reduce_scatter`; ``t_out`` is valid after ``wait()``. 16-bit
        inputs are reduced in float32 (``t_out`` may be float32 to keep that precision),
        except with ``sum16`` (bfloat16 in and out)."""
        rec = self.recorder.post("ireduce_scatter", self.axis, -1, t_in.nbytes)
        wire = op == "sum16"
        src = t_in.float() if _low(t_in) and not wire else t_in
        dst = t_out.float() if not wire and (_low(t_out) or src.dtype != t_out.dtype) \
            else t_out
        bufs = _Buffers()

        def finalise():
            bufs.done()
            if dst is not t_out:
                t_out.copy_(dst)

        if self.size == 1:
            dst.copy_(src)
            return Handle(self.recorder, _DoneRequest(), rec, finalise=finalise)
        req = self.mpi.Ireduce_scatter_block(bufs(src), bufs(dst, write=True), _op(op))
        return Handle(self.recorder, req, rec, finalise=finalise, keep=(src, dst))

    # -- data movement -----------------------------------------------------------------
    def allgather(self, t_in: torch.Tensor, t_out: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t_in`` along dim 0 into ``t_out`` (rank order)."""
        if self.size == 1:
            return t_out.copy_(t_in)
        bufs = _Buffers()
        sb, rb = bufs(t_in, raw=True), bufs(t_out, write=True, raw=True)
        self._blocking("allgather", t_out, t_out.nbytes, lambda: self.mpi.Allgather(sb, rb),
                       lambda: self.mpi.Iallgather(sb, rb))
        bufs.done()
        return t_out

    def iallgather(self, t_in: torch.Tensor, t_out: torch.Tensor) -> Handle:
        """Nonblocking :meth:`allgather`; ``t_out`` is valid after ``wait()``."""
        rec = self.recorder.post("iallgather", self.axis, -1, t_out.nbytes)
        if self.size == 1:
            t_out.copy_(t_in)
            return Handle(self.recorder, _DoneRequest(), rec)
        bufs = _Buffers()
        req = self.mpi.Iallgather(bufs(t_in, raw=True), bufs(t_out, write=True, raw=True))
        return Handle(self.recorder, req, rec, finalise=bufs.done, keep=(t_in, t_out))

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.size > 1:
            bufs = _Buffers()
            buf = bufs(t, write=True)
            self._run("bcast", t.nbytes, lambda: self.mpi.Bcast(buf, root=root))
            bufs.done()
        return t

    def bcast_obj(self, obj, root: int = 0):
        """Broadcast a small picklable control object (never model data); recorded with 0
        bytes (pickled, its size is not known here)."""
        if self.size == 1:
            return obj
        return self._run("bcast_obj", 0, lambda: self.mpi.bcast(obj, root=root))

    def allgather_obj(self, obj) -> list:
        """Gather a small control object (strings, numbers) from every rank (recorded as
        :meth:`bcast_obj`)."""
        if self.size == 1:
            return [obj]
        return self._run("allgather_obj", 0, lambda: self.mpi.allgather(obj))

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
        rec = self.recorder.post("ialltoallv", self.axis, -1, send.nbytes)
        return Handle(self.recorder, self.mpi.Ialltoallv(s, r), rec, finalise=bufs.done,
                      keep=(send, recv, s, r))

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        rec = self.recorder.post("isend", self.axis, dest, t.nbytes)
        buf = _Buffers()(t)
        return Handle(self.recorder, self.mpi.Isend(buf, dest=dest, tag=tag), rec,
                      keep=(t, buf))

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Handle:
        rec = self.recorder.post("irecv", self.axis, source, t.nbytes)
        bufs = _Buffers()
        buf = bufs(t, write=True)
        return Handle(self.recorder, self.mpi.Irecv(buf, source=source, tag=tag), rec,
                      finalise=bufs.done, keep=(t, buf))

    def barrier(self) -> None:
        self._run("barrier", 0, self.mpi.Barrier)

    def dup(self, axis: str | None = None, recorder: Recorder | None = None) -> Group:
        """The same ranks on a new communicator (``MPI_Comm_dup``): collectives on it never
        match this group's, e.g. a background writer thread's. Collective."""
        return Group(self.mpi.Dup(), axis or f"{self.axis}-dup", recorder)
