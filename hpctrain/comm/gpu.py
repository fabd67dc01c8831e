"""The GPU side of ``comm``: CUDA tensors as MPI buffers.

Two paths, chosen once per process and reported at start (:func:`describe`):

* **CUDA-aware MPI**: the tensor is handed over zero-copy as a CuPy array made from it by
  DLPack (or, without CuPy, through the tensor's own ``__cuda_array_interface__``).
* **Host staging**: the tensor is copied into a pinned host buffer, MPI works on that, and
  buffers MPI writes into are copied back when the operation completes.

Either way the producing CUDA stream is synchronised first, in :func:`mpi_buffer` and nowhere
else (invariant 6: MPI sees GPU buffers only when they are ready).

Whether the MPI is CUDA-aware: ``HPCTRAIN_GPU_AWARE_MPI=0|1`` when set; else Open MPI's
``MPIX_Query_cuda_support()``; else assume not. Nothing here imports CUDA libraries unless a
CUDA tensor actually reaches MPI, so CPU machines never load them.

For tests on machines without a GPU, :func:`stand_in` swaps in a backend that treats host
tensors as device tensors and exposes them through ``__cuda_array_interface__`` over host
memory (the technique mpi4py's own test-suite uses), so conversion and staging are covered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from contextlib import contextmanager

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
_AWARE: bool | None = None


def query_cuda_aware() -> bool:
    """HPCTRAIN_GPU_AWARE_MPI if set, else Open MPI's MPIX_Query_cuda_support, else False."""
    env = os.environ.get("HPCTRAIN_GPU_AWARE_MPI")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"HPCTRAIN_GPU_AWARE_MPI must be 0 or 1, got {env!r}")
        return env == "1"
    for name in (None, ctypes.util.find_library("mpi")):
        try:
            fn = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL).MPIX_Query_cuda_support
        except (OSError, AttributeError, TypeError):
            continue
        return bool(fn())
    return False


def cuda_aware() -> bool:
    global _AWARE
    if _AWARE is None:
        _AWARE = query_cuda_aware()
    return _AWARE


def is_device_tensor(t: torch.Tensor) -> bool:
    return BACKEND.is_device(t)


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
    path = "CUDA-aware MPI (zero-copy)" if cuda_aware() else "host staging (pinned buffers)"
    return f"GPU buffers to MPI via {path}"


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
    BACKEND, _AWARE = StandInBackend(), aware
    try:
        yield BACKEND
    finally:
        BACKEND, _AWARE = saved
