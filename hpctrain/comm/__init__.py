"""The only door to MPI: every collective and transfer of the trainer goes through here.

- ``group.py``: :class:`Group` (one communicator: collectives, nonblocking operations,
  point-to-point) and :class:`Handle`; tensors as zero-copy MPI buffers.
- ``records.py``: :class:`Recorder`, the per-run record of every operation (per-axis time
  and bytes, the flight-recorder ring).
- ``setup.py``: building communicators (world, Cartesian grid, sub-communicators, node-local
  splits) and process-level calls (abort, finalize, MPI-IO hints, the thread level, the
  library's name and version).
- ``gpu.py``: the GPU buffer seam (CUDA-aware MPI or host staging).
"""

from .group import PROC_NULL, Group, Handle, wait_all
from .records import OpRecord, Recorder
from .setup import (
    abort,
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

__all__ = ["PROC_NULL", "Group", "Handle", "OpRecord", "Recorder", "abort", "cartesian",
           "finalize", "library", "mpi_info", "node_local", "processor_name", "shift", "split",
           "sub", "thread_multiple", "wait_all", "with_recorder", "world", "wtime"]
