"""The only door to MPI: every collective and transfer of the trainer goes through here.

- ``group.py``: :class:`Group` (one communicator: collectives, nonblocking operations,
  point-to-point) and :class:`Handle`; tensors as zero-copy MPI buffers.
- ``records.py``: :class:`Recorder`, the per-run record of every operation (per-axis time
  and bytes, the flight-recorder ring).
- ``setup.py``: building communicators (world, Cartesian grid, sub-communicators, node-local
  splits) and process-level calls (abort, finalize, MPI-IO hints, the thread level).
- ``gpu.py``: the GPU buffer seam (CUDA-aware MPI or host staging).
- ``offload.py``: :class:`Offload`, a thread owning duplicate communicators that runs
  blocking collectives while the caller computes (overlapped gradient reduction).
"""

import os as _os

# Open MPI's nonblocking all-reduce (libnbc, used by overlapped and nonblocking gradient
# reductions) picks its algorithm by size and rank count; with a few ranks and MB buckets
# its default was 1.6x slower than the ring over TCP (docs/benchmarks.md, "Overlap"): ask for
# the ring algorithm. An MCA parameter is read when MPI initialises,
# so this counts only when hpctrain is imported before mpi4py.MPI; scripts/mpi-env.sh sets it
# for every local launch, and a value already in the environment wins.
_os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")

from .group import PROC_NULL, Group, Handle, wait_all  # noqa: E402 - after the MCA default
from .offload import Offload  # noqa: E402
from .records import OpRecord, Recorder  # noqa: E402
from .setup import (  # noqa: E402
    abort,
    cartesian,
    finalize,
    mpi_info,
    node_local,
    processor_name,
    shift,
    split,
    sub,
    thread_multiple,
    with_recorder,
    world,
    wtime,
)

__all__ = ["PROC_NULL", "Group", "Handle", "Offload", "OpRecord", "Recorder", "abort", "cartesian",
           "finalize", "mpi_info", "node_local", "processor_name", "shift", "split", "sub",
           "thread_multiple", "wait_all", "with_recorder", "world", "wtime"]
