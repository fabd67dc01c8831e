"""Allreduce bandwidth on GPU buffers: hpctrain's comm.py (torch tensor -> CuPy/DLPack or
staging) vs a raw mpi4py Allreduce on a CuPy buffer. Run under mpirun -n 2."""

import time

import torch
from mpi4py import MPI

from hpctrain import comm
from hpctrain.comm import gpu


def seconds(fn, world, reps=10):
    fn()
    torch.cuda.synchronize()
    world.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure(world, nbytes):
    t = torch.ones(nbytes // 4, device="cuda")
    ours = seconds(lambda: world.allreduce_(t), world)
    try:
        import cupy

        c = cupy.ones(nbytes // 4, dtype=cupy.float32)

        def raw_call():
            cupy.cuda.get_current_stream().synchronize()
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, c, MPI.SUM)
    except ImportError:
        def raw_call():
            torch.cuda.synchronize()
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t, MPI.SUM)
    raw = seconds(raw_call, world)
    factor = 2 * (world.size - 1) / world.size * nbytes / 1e9  # bus bandwidth
    return f"| {nbytes:,} | {factor / ours:.2f} | {factor / raw:.2f} | {raw / ours:.2f} |"


def main():
    world = comm.world()
    gpu.select_device(world.rank)
    rows = ["| bytes | comm.py GB/s | raw CuPy GB/s | raw/comm.py time |", "|---:|---:|---:|---:|"]
    rows += [measure(world, n) for n in (1 << 20, 16 << 20, 128 << 20)]
    if world.rank == 0:
        print(f"path: {gpu.describe()}\n")
        print("\n".join(rows))


main()
