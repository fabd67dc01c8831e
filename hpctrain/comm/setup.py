"""Communicator construction and process-level MPI calls (used by ``topology.py``).

Each function that builds a communicator from a :class:`Group` is collective over it and
gives the new group the parent's :class:`Recorder`, so a run's groups report to one record.
"""

from __future__ import annotations

from mpi4py import MPI

from .group import PROC_NULL, Group
from .records import Recorder


def world(recorder: Recorder | None = None) -> Group:
    """MPI_COMM_WORLD as a Group (with a new Recorder unless one is given)."""
    return Group(MPI.COMM_WORLD, "world", recorder)


def with_recorder(group: Group, recorder: Recorder) -> Group:
    """The same communicator, reporting to ``recorder``. Not collective."""
    return Group(group.mpi, group.axis, recorder)


def cartesian(world_group: Group, dims, key: int | None = None) -> Group:
    """A non-periodic Cartesian communicator. ``key`` (the same choice on every rank: all
    None or all ints) reorders ranks for a placement; collective over the world."""
    base = world_group.mpi
    if key is not None:
        base = base.Split(0, key)
    return Group(base.Create_cart(list(dims), periods=[False] * len(dims), reorder=False),
                 "grid", world_group.recorder)


def sub(cart: Group, remain, axis: str) -> Group:
    return Group(cart.mpi.Sub(list(remain)), axis, cart.recorder)


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
    return Group(cart.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=cart.rank), axis, cart.recorder)


def split(group: Group, color: int, key: int, axis: str) -> Group:
    """Ranks of ``group`` with the same ``color`` form one new group, ordered by ``key``.
    Collective over ``group``."""
    return Group(group.mpi.Split(color, key), axis, group.recorder)


def library() -> str:
    """The MPI library and its version, one line (the first of ``MPI_Get_library_version``,
    e.g. ``Open MPI v4.1.4, package: Debian OpenMPI`` or ``MPICH Version: 4.0.2``), the standard it
    implements and mpi4py's version: the first line every run logs."""
    import mpi4py

    lines = [" ".join(x.replace("\0", " ").split())
             for x in MPI.Get_library_version().splitlines()]
    first = next((x for x in lines if x), "unknown MPI library")
    first = ", ".join(first.split(", ")[:2])  # Open MPI goes on: ident, repo rev, date
    major, minor = MPI.Get_version()
    return f"{first[:100]} (MPI {major}.{minor}; mpi4py {mpi4py.__version__})"


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


def thread_multiple() -> tuple[bool, str]:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py requests it by
    default, ``mpi4py.rc.thread_level``), and the level it provides, by name."""
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
             MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    level = MPI.Query_thread()
    return level == MPI.THREAD_MULTIPLE, names.get(level, str(level))


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



def applied_hints(group, path, info) -> dict[str, str]:
    """The MPI-IO hints the MPI library applies to ``path`` opened (created if absent) over
    ``group`` with ``info``: ``MPI_File_get_info`` of an open/close of the file (ROMIO
    reports every hint in effect, defaults and striping included; keys it ignored are
    absent). Collective."""
    fh = MPI.File.Open(group.mpi, str(path), MPI.MODE_CREATE | MPI.MODE_WRONLY, info)
    try:
        got = fh.Get_info()
        out = {got.Get_nthkey(i): got.Get(got.Get_nthkey(i)) for i in range(got.Get_nkeys())}
        got.Free()
    finally:
        fh.Close()
    return {k: v for k, v in sorted(out.items()) if v is not None}
