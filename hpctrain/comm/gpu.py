"""The GPU side of ``comm``: CUDA tensors as MPI buffers.

Two paths, chosen once per process and reported at start (:func:`describe`):

* **CUDA-aware MPI**: the tensor is handed over zero-copy as a CuPy array made from it by
  DLPack (or, without CuPy, through the tensor's own ``__cuda_array_interface__``).
* **Host staging**: the tensor is copied into a pinned host buffer, MPI works on that, and
  buffers MPI writes into are copied back when the operation completes.

Either way the producing CUDA stream is synchronised first, in :func:`mpi_buffer` and nowhere
else (invariant 6: MPI sees GPU buffers only when they are ready).

Whether the MPI is CUDA-aware is decided once by :func:`decide`, the first rule that applies:

1. ``HPCTRAIN_GPU_AWARE_MPI=0|1``: the explicit override;
2. Cray MPICH (named by ``MPI_Get_library_version``): ``MPICH_GPU_SUPPORT_ENABLED=1``;
3. MVAPICH: ``MV2_USE_CUDA=1`` (MVAPICH2-GDR);
4. MPICH 4 (and its derivatives): ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)``;
5. Open MPI: ``MPIX_Query_cuda_support()``;
6. otherwise not aware (host staging).

:func:`describe` names the rule that decided. Nothing here imports CUDA libraries unless a
CUDA tensor actually reaches MPI, so CPU machines never load them.

For tests on machines without a GPU, :func:`stand_in` swaps in a backend that treats host
tensors as device tensors and exposes them through ``__cuda_array_interface__`` over host
memory (the technique mpi4py's own test-suite uses), so conversion and staging are covered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class CudaBackend:
    """The real thing: torch CUDA tensors, CuPy when installed."""

    name = "cuda"

    def is_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def synchronize(self, t: torch.Tensor) -> None:
        torch.cuda.current_stream(t.device).synchronize()

    def device_array(self, t: torch.Tensor):
        try:
            import cupy
        except ImportError:  # torch tensors expose __cuda_array_interface__ themselves
            return t
        return cupy.from_dlpack(t)

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class _HostCudaArray:
    """A host tensor presented as a CUDA array (for tests without a GPU)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": t.numpy().dtype.str,
            "data": (t.data_ptr(), False), "version": 3, "strides": None,
        }


class StandInBackend(CudaBackend):
    """Treats every CPU tensor as a device tensor; counts what it did."""

    name = "stand-in"

    def __init__(self):
        self.synced = 0
        self.staged = 0

    def is_device(self, t: torch.Tensor) -> bool:
        return True

    def synchronize(self, t: torch.Tensor) -> None:
        self.synced += 1

    def device_array(self, t: torch.Tensor):
        return _HostCudaArray(t)

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        self.staged += 1
        return torch.empty(t.shape, dtype=t.dtype)


BACKEND: CudaBackend = CudaBackend()
MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h


@dataclass(frozen=True)
class Awareness:
    """Whether MPI takes CUDA buffers, and the rule that decided it (for :func:`describe`)."""

    aware: bool
    decided_by: str


_AWARE: Awareness | None = None


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "yes", "true", "enabled", "on")


def decide(env: Mapping[str, str], library: str,
           lookup: Callable[[str], Callable | None]) -> Awareness:
    """The decision table (module docstring) on its inputs: the environment, the MPI
    library's version text and ``lookup(symbol)`` -> a C function of the loaded MPI or None."""
    override = env.get("HPCTRAIN_GPU_AWARE_MPI")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"HPCTRAIN_GPU_AWARE_MPI must be 0 or 1, got {override!r}")
        return Awareness(override == "1", f"HPCTRAIN_GPU_AWARE_MPI={override}")
    lib = library.upper()
    if "CRAY MPICH" in lib:
        on = _flag(env, "MPICH_GPU_SUPPORT_ENABLED")
        return Awareness(on, f"Cray MPICH, MPICH_GPU_SUPPORT_ENABLED={'1' if on else 'unset/0'}")
    if "MVAPICH" in lib:
        on = _flag(env, "MV2_USE_CUDA")
        return Awareness(on, f"MVAPICH, MV2_USE_CUDA={'1' if on else 'unset/0'}")
    fn = lookup("MPIX_GPU_query_support")
    if fn is not None:
        out = ctypes.c_int(0)
        fn(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(out))
        return Awareness(bool(out.value), "MPICH's MPIX_GPU_query_support(CUDA)")
    fn = lookup("MPIX_Query_cuda_support")
    if fn is not None:
        return Awareness(bool(fn()), "Open MPI's MPIX_Query_cuda_support()")
    return Awareness(False, "no query in this MPI and no override")


def _mpi_symbol(name: str) -> Callable | None:
    """A C function of the MPI library mpi4py loaded: searched through mpi4py's extension
    module and its dependencies, the process, then libmpi / libmpich by name, but only among
    libraries already loaded (RTLD_NOLOAD: another family's library, loaded beside the one
    in use and never initialised, would abort the process when called)."""
    from mpi4py import MPI

    mode = getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL
    for lib in (MPI.__file__, None, ctypes.util.find_library("mpi"),
                ctypes.util.find_library("mpich")):
        try:
            return getattr(ctypes.CDLL(lib, mode=mode), name)
        except (OSError, AttributeError, TypeError):
            continue
    return None


def query() -> Awareness:
    """:func:`decide` on this process: its environment, its MPI library."""
    from mpi4py import MPI

    return decide(os.environ, MPI.Get_library_version(), _mpi_symbol)


def query_cuda_aware() -> bool:
    return query().aware


def awareness() -> Awareness:
    global _AWARE
    if _AWARE is None:
        _AWARE = query()
    return _AWARE


def cuda_aware() -> bool:
    return awareness().aware


def mpi_buffer(t: torch.Tensor, write: bool):
    """(buffer for MPI, finish) for a device tensor. ``finish`` (or None) copies a staged
    host buffer back into ``t``; call it when MPI has completed writing (``write=True``)."""
    BACKEND.synchronize(t)  # the one place: kernels producing t have finished
    if cuda_aware():
        return BACKEND.device_array(t), None
    host = BACKEND.host_buffer(t)
    host.copy_(t)
    return host.numpy(), ((lambda: t.copy_(host)) if write else None)


def describe() -> str:
    a = awareness()
    path = "CUDA-aware MPI (zero-copy)" if a.aware else "host staging (pinned buffers)"
    return f"GPU buffers to MPI via {path}, decided by {a.decided_by}"


def select_device(local_rank: int) -> torch.device:
    """One rank per GPU: node-local rank modulo the visible devices (under SLURM,
    CUDA_VISIBLE_DEVICES already narrows what is visible to each task)."""
    if not torch.cuda.is_available():
        raise RuntimeError("model.device = cuda but no CUDA device is visible to this rank")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_for(kind: str, local_rank: int) -> torch.device:
    return select_device(local_rank) if kind == "cuda" else torch.device("cpu")


@contextmanager
def stand_in(aware: bool):
    """Run comm's GPU path on host memory (tests): every tensor counts as a device
    tensor; ``aware`` picks zero-copy or staging."""
    global BACKEND, _AWARE
    saved = BACKEND, _AWARE
    BACKEND, _AWARE = StandInBackend(), Awareness(aware, "the test stand-in")
    try:
        yield BACKEND
    finally:
        BACKEND, _AWARE = saved
