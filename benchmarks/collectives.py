"""Collective microbenchmarks per topology axis, through ``hpctrain.comm`` (OSU-style): latency
and algorithmic bandwidth (message bytes / latency) of allreduce, allgather,
reduce-scatter, all-to-all and send/recv over message sizes, on a (dp=2, tp=2) grid: the
``tp`` axis, the ``dp`` axis, and the whole world."""

from __future__ import annotations

import time

import torch

from hpctrain.config import TopologyConfig
from hpctrain.topology import Topology

from .common import result

RANKS = (4,)
SIZES_B = {"tiny": [8, 1024, 65536], "small": [8, 128, 2048, 32768, 524288, 4194304]}
OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "sendrecv")


def _iters(nbytes: int, size: str) -> int:
    budget = 2e5 if size == "tiny" else 2e7  # bytes moved per measurement, about
    return int(max(3, min(50, budget // max(nbytes, 1))))


def _op(group, name: str, nbytes: int):
    """A closure running one ``name`` of ``nbytes`` (per rank's message) on ``group``."""
    n = max(group.size, nbytes // 4 // group.size * group.size)  # float32 elements
    x = torch.ones(n)
    if name == "allreduce":
        return lambda: group.allreduce_(x)
    if name == "allgather":
        out = torch.empty(n * group.size)
        return lambda: group.allgather(x, out)
    if name == "reduce_scatter":
        out = torch.empty(n // group.size)
        return lambda: group.reduce_scatter(x, out)
    if name == "alltoall":
        out = torch.empty(n)
        counts = [n // group.size] * group.size
        return lambda: group.alltoallv(x, counts, out, counts)
    # sendrecv: ping-pong between ranks 0 and 1 of the group; latency = half a round trip.
    y = torch.empty(n)

    def pingpong():
        if group.rank == 0:
            group.isend(x, 1).wait()
            group.irecv(y, 1).wait()
        elif group.rank == 1:
            group.irecv(y, 0).wait()
            group.isend(x, 0).wait()
    return pingpong


def _measure(world, group, name: str, nbytes: int, size: str, repeats: int) -> float:
    """Median over repeats of the slowest rank's mean seconds per operation. Collective
    over ``world`` (every axis group runs at once, as in training)."""
    fn, iters = _op(group, name, nbytes), _iters(nbytes, size)
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        world.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dt = (time.perf_counter() - t0) / iters
        samples.append(world.allreduce(dt / 2 if name == "sendrecv" else dt, "max"))
    samples.sort()
    return samples[len(samples) // 2]


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world`` (4 ranks: dp=2 x tp=2)."""
    topo = Topology(TopologyConfig(dp=2, tp=2), world)
    axes = {"tp": topo.tp_comm, "dp": topo.dp_comm, "world": topo.world}
    table = []
    for axis, group in axes.items():
        for name in OPS:
            for nbytes in SIZES_B[size]:
                s = _measure(world, group, name, nbytes, size, repeats)
                table.append({"axis": axis, "ranks": group.size, "op": name, "bytes": nbytes,
                              "latency_us": s * 1e6, "bw_MBps": nbytes / s / 1e6})
    out = result("collectives", world, size, repeats,
                 "comm.Group collectives per axis of a dp=2 x tp=2 grid")
    out["table"] = table
    out["check"] = {"what": "every (axis, op, size) measured", "values": {},
                    "rel_err": 0.0, "tol": 0.0,
                    "ok": len(table) == len(axes) * len(OPS) * len(SIZES_B[size])}
    out["notes"].append("latency = slowest rank's mean per operation (send/recv: half a "
                        "ping-pong round trip); bandwidth = message bytes per rank / latency")
    return out
