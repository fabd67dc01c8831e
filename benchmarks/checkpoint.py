"""Checkpoint bandwidth: hpctrain's one parallel-HDF5 file against every rank
``torch.save``-ing its own shard and against one raw sequential write of the same bytes.

The model is synthetic: ``TENSORS`` float32 matrices whose rows are split over all ranks
(like tensor parallelism), so every rank writes and reads its own hyperslab of every tensor.
Times are the slowest rank's, each including ``fsync``; bandwidth = checkpoint bytes / time.
hpctrain's save also includes the checksum read-back and the atomic commit, so its write
phase alone is reported too. Loads right after saves are served from the page cache.

Two entry points, both collective over ``world``:
``run(world, size, repeats) -> dict`` (``python -m benchmarks``) and ``measure(world, mb,
repeats, directory) -> list[dict]`` (one row per variant); ``mpirun -n 4 python -m mpi4py -m
benchmarks.checkpoint --mb 64`` (from the repository root) prints the rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hpctrain.checkpoint import Checkpointer, store
from hpctrain.config import CheckpointConfig, TopologyConfig
from hpctrain.model import ParamMeta, shard_range
from hpctrain.topology import Topology

from .common import median, result, row

RANKS = (2, 4)
SIZES_MB = {"tiny": 16, "small": 256}
TENSORS = 8


class _NoOptimizer:
    state: dict = {}
    step_count = 0


def _shards(mb: float, topo) -> list:
    """(name, local tensor with .hp) for TENSORS matrices of mb MiB in all, rows over tp."""
    cols = 1024
    rows = max(topo.tp_size, int(mb * 2**20 / 4 / cols / TENSORS))
    out = []
    for i in range(TENSORS):
        meta = ParamMeta((rows, cols), tp_dim=0)
        _, _, local = shard_range(rows, topo.tp_size, topo.tp_rank)
        t = torch.randn(local, cols, generator=torch.Generator().manual_seed(i))
        t.hp = meta
        out.append((f"w{i}", t))
    return out


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _timed(world, fn) -> float:
    world.barrier()
    t0 = time.perf_counter()
    fn()
    world.barrier()
    return world.allreduce(time.perf_counter() - t0, "max")


def _variants(world, topo, params, nbytes: int, d: Path) -> dict:
    """One measurement of every variant: {name: seconds}."""
    out = {}
    saver = Checkpointer(CheckpointConfig(keep=1), topo, d / "h5")
    out["hdf5 save (hpctrain)"] = _timed(world, lambda: saver.save(1, params, _NoOptimizer, {}))
    out["hdf5 write phase"] = saver.take_metrics()["ckpt_write_s"]
    out["hdf5 load (hpctrain)"] = _timed(
        world, lambda: saver.load(d / "h5" / store.step_name(1), params, _NoOptimizer))
    # Independent I/O only (each rank its own hyperslabs): collective threshold out of reach.
    indep = Checkpointer(CheckpointConfig(keep=1), topo, d / "h5", collective_min_bytes=1 << 62)
    out["hdf5 save, independent I/O"] = _timed(
        world, lambda: indep.save(2, params, _NoOptimizer, {}))
    out["hdf5 write phase, independent I/O"] = indep.take_metrics()["ckpt_write_s"]
    mine = d / f"shard_{world.rank}.pt"
    shard = {n: p.detach() for n, p in params}
    out["torch.save per rank"] = _timed(world, lambda: (torch.save(shard, mine), _fsync(mine)))
    out["torch.load per rank"] = _timed(world, lambda: torch.load(mine, weights_only=True))
    raw = d / "raw.bin"
    blob = os.urandom(1 << 20)

    def write_raw():
        if world.rank == 0:
            with open(raw, "wb") as fh:
                for _ in range(nbytes >> 20):
                    fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())

    def read_raw():
        if world.rank == 0:
            with open(raw, "rb") as fh:
                while fh.read(8 << 20):
                    pass

    out["raw sequential write (1 rank)"] = _timed(world, write_raw)
    out["raw sequential read (1 rank)"] = _timed(world, read_raw)
    return out


def measure(world, mb: float, repeats: int, directory: str | None = None) -> list[dict]:
    """Rows {variant, ranks, MiB, median_s, GBps, samples} (rank 0's are the result)."""
    topo = Topology(TopologyConfig(tp=world.size), world)
    params = _shards(mb, topo)
    nbytes = int(world.allreduce(float(sum(p.numel() * 4 for _, p in params))))
    nbytes -= nbytes % (1 << 20)  # the raw write moves whole MiB
    base = world.bcast_obj(tempfile.mkdtemp(prefix="hpctrain-ckpt-bench-", dir=directory)
                           if world.rank == 0 else None)
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(repeats):
            for name, s in _variants(world, topo, params, nbytes, Path(base)).items():
                samples.setdefault(name, []).append(s)
    finally:
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return [{"variant": name, "ranks": world.size, "MiB": nbytes / 2**20,
             "median_s": median(s), "GBps": nbytes / median(s) / 1e9, "samples": s}
            for name, s in samples.items()]


def run(world, size: str, repeats: int) -> dict:
    rows = measure(world, SIZES_MB[size], repeats)
    out = result("checkpoint", world, size, repeats,
                 f"checkpoint save/load of {SIZES_MB[size]} MiB float32 split over "
                 f"{world.size} ranks")
    out["rows"] = [row(r["variant"], r["samples"]) for r in rows]
    out["table"] = rows
    out["notes"].append("hpctrain save = collective write + checksum read-back + fsync + "
                        "atomic rename; loads follow saves, so reads come from the page cache")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint")
    p.add_argument("--mb", type=float, default=64.0, help="checkpoint size in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = p.parse_args(argv)
    from hpctrain import comm

    world = comm.world()
    rows = measure(world, args.mb, args.repeats, args.dir)
    if world.rank == 0:
        print("| variant | ranks | MiB | median s | GB/s |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['ranks']} | {r['MiB']:.0f} | {r['median_s']:.3f} "
                  f"| {r['GBps']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
