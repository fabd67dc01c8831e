"""Allreduce bandwidth through hpctrain's ``comm`` (a torch tensor handed to MPI by
``comm/gpu.py``: zero-copy or host staging) vs the same operation written by hand with mpi4py.

The hand-written baseline follows the path in use: with a CUDA-aware MPI, ``Allreduce`` on a
CuPy array (or on the torch tensor through ``__cuda_array_interface__`` without CuPy); with
host staging, a pinned host copy, ``Allreduce`` on it and a copy back. (A device pointer is
never handed to an MPI that is not CUDA-aware: that would crash, not measure.) Every size is
checked for the right sum first. ``--device cpu`` (the dry run) runs the same code on host
tensors: timings there are CPU figures, printed only to prove the script.

Run under ``mpirun -n 2 python -m mpi4py tests/gpu/allreduce_bw.py [--device cuda]``.
"""

import argparse
import time

import torch
from mpi4py import MPI

from hpctrain import comm
from hpctrain.comm import gpu


def seconds(fn, world, sync, reps):
    fn()
    sync()
    world.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def raw_call(t: torch.Tensor, dev: str):
    """The hand-written mpi4py equivalent of comm's allreduce on this path."""
    w = MPI.COMM_WORLD
    if dev == "cpu":
        a = t.numpy()
        return lambda: w.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
    if gpu.cuda_aware():
        try:
            import cupy

            c = cupy.from_dlpack(t)

            def call():
                torch.cuda.current_stream().synchronize()
                w.Allreduce(MPI.IN_PLACE, c, MPI.SUM)
        except ImportError:
            def call():
                torch.cuda.current_stream().synchronize()
                w.Allreduce(MPI.IN_PLACE, t, MPI.SUM)
        return call
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h = host.numpy()

    def staged():
        host.copy_(t)  # synchronous device-to-host copy: t is ready
        w.Allreduce(MPI.IN_PLACE, h, MPI.SUM)
        t.copy_(host)
    return staged


def measure(world, nbytes: int, dev: str, reps: int) -> str:
    n = nbytes // 4
    t = torch.full((n,), float(world.rank + 1), device=dev)
    world.allreduce_(t)  # correctness first: sum over ranks of (rank + 1)
    want = world.size * (world.size + 1) / 2
    got = float(t[0].item()), float(t[-1].item())
    if got != (want, want):
        raise SystemExit(f"allreduce of {nbytes} bytes on {dev}: got {got}, expected {want}")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ours = seconds(lambda: world.allreduce_(t), world, sync, reps)
    raw = seconds(raw_call(t, dev), world, sync, reps)
    bus = 2 * (world.size - 1) / world.size * nbytes / 1e9  # bus bandwidth (GB per op)
    return f"| {nbytes:,} | {bus / ours:.2f} | {bus / raw:.2f} | {ours / raw:.2f} |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sizes-mb", default="1,16,128,512")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    world = comm.world()
    if a.device == "cuda":
        gpu.select_device(world.rank)
    sizes = [int(float(s) * (1 << 20)) for s in a.sizes_mb.split(",")]
    rows = ["| bytes (float32) | comm bus GB/s | hand-written bus GB/s | comm / hand time |",
            "|---:|---:|---:|---:|"]
    rows += [measure(world, n, a.device, a.reps) for n in sizes]
    if world.rank == 0:
        path = gpu.describe() if a.device == "cuda" else "host tensors (--device cpu)"
        gpus = torch.cuda.device_count() if a.device == "cuda" else 0
        print(f"path: {world.size} ranks, {path}, {gpus} GPU(s) visible")
        if a.device == "cpu":
            print("note: dry run on CPU; these are CPU timings, not GPU figures")
        print("\n".join(rows), flush=True)


main()
