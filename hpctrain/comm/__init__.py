"""The only door to MPI: every collective and transfer of the trainer goes through here.

- ``group.py``: :class:`Group` (one communicator: collectives, nonblocking operations,
  point-to-point) and :class:`Handle`; tensors as zero-copy MPI buffers.
- ``records.py``: :class:`Recorder`, the per-run record of every operation (per-axis time
  and bytes, the flight-recorder ring).
- ``setup.py``: building communicators (world, Cartesian grid, sub-communicators, node-local
  splits) and process-level calls (abort, finalize, MPI-IO hints requested and
  applied, the thread level, the library's name and version).
- ``gpu.py``: the GPU buffer seam (CUDA-aware MPI or host staging).
- ``fatal.py``: :func:`abort_on_exception`, an uncaught exception on any rank aborts the job.
- ``sum16.py``: ``sum16``, the MPI op that sums bfloat16 words (16-bit gradient traffic).
- ``progress.py``: :class:`ProgressThread`, a thread owning duplicate communicators that runs
  blocking collectives while the caller computes (overlapped gradient reduction).
"""

from .fatal import abort_on_exception
from .group import PROC_NULL, Group, Handle, wait_all
from .progress import ProgressThread
from .records import OpRecord, Recorder
from .setup import (
    abort,
    applied_hints,
    cartesian,
    finalize,
    library,
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

__all__ = ["PROC_NULL", "Group", "Handle", "ProgressThread", "OpRecord", "Recorder", "abort",
           "abort_on_exception", "applied_hints", "cartesian", "finalize", "library",
           "mpi_info", "node_local", "processor_name", "shift", "split", "sub",
           "thread_multiple", "wait_all", "with_recorder", "world", "wtime"]
