"""Multi-node: the communication design, not the rank count, decides speed.

``hpctrain bench --only cluster`` makes 2 simulated nodes x 2 ranks on this machine
(``scripts/cluster.sh``: network namespaces, one veth link per node shaped to
``RATE`` (``HPCTRAIN_CLUSTER_RATE``, default 200mbit) by a token bucket, Open MPI over
TCP between nodes, shared memory within) and runs ONE ``mpirun`` over them in which every
variant trains the same model and global batch with ``hpctrain.train.train``, interleaved
repeat by repeat:

(a) tp inside nodes (``placement=auto``) vs tp across the link (``naive``), dp=2 x tp=2;
(b) flat vs hierarchical dp reduction, dp=4; (c) bucketed + overlapped vs one blocking
all-reduce per parameter, dp=4; (d) 1 node x 2 ranks (the node-0 ranks alone, node 1 idle and
sleeping) vs 2 nodes x 2 ranks: strong-scaling efficiency; and a sweep of bucket size x
overlap on the slow link. Each with the share of the step spent in exposed communication
(``comm_s`` of metrics.jsonl, rank 0). Registered at world size 1: that rank only drives
the cluster (``run``); the ranks inside it run :func:`main`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .common import median, ratio, result, row, same_losses

RANKS = (1,)
# The link: this machine computes ~10 GFLOP/s, so 200 Mbit/s gives about the FLOP-per-bit
# balance of a GPU node on a 200-400 Gbit/s network (1 Gbit/s here is relatively faster).
RATE = os.environ.get("HPCTRAIN_CLUSTER_RATE", "200mbit")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"
MODEL = {  # float32; at small 14 MB of gradients in 67 tensors, and tp activations of
    # 12 MB per rank per step (512 tokens x 192 x 4 B x 4 all-reduces x 8 layers / tp 2)
    "tiny": ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "train.steps=2",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=16"],
    "small": ["model.n_layers=8", "model.d_model=192", "model.n_heads=4", "train.steps=4",
              "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=128"],
}
DP4 = ["topology.dp=4"]
VARIANTS = {  # name -> (ranks used: 2 = node 0 only, overrides, reduction override)
    # (a) with blocking buckets on both sides: placement alone differs (see b).
    "a: tp inside nodes (auto)": (4, ["topology.dp=2", "topology.tp=2"], "blocking"),
    "a: tp across the link (naive)": (4, ["topology.dp=2", "topology.tp=2",
                                          "topology.placement=naive"], "blocking"),
    "b: dp flat (nonblocking buckets)": (4, DP4, None),
    "b: dp flat (blocking buckets)": (4, DP4, "blocking"),
    "b: dp hierarchical": (4, [*DP4, "topology.dp_reduction=hierarchical"], None),
    "c: bucketed + overlapped": (4, [*DP4, "optim.overlap=true"], None),
    "c: per-parameter": (4, DP4, "per-parameter"),
    "d: 1 node x 2 ranks": (2, ["topology.dp=2", "optim.overlap=true"], None),
}
SWEEP_MB = (0.25, 16.0)  # with the default 4 MB of b/c: bucket size x overlap


def variants(size: str) -> dict:
    out = dict(VARIANTS)
    if size != "tiny":
        for mb in SWEEP_MB:
            for ov in (False, True):
                out[f"sweep: bucket {mb:g} MB, overlap {'on' if ov else 'off'}"] = (
                    4, [*DP4, f"optim.bucket_mb={mb}", f"optim.overlap={str(ov).lower()}"],
                    None)
    return out


# -- rank side (inside the cluster) ------------------------------------------------------------
def _reduce_blocking(grads) -> None:
    """Each bucket by one blocking all-reduce, in order (zero 0, no overlap; bench only)."""
    for b in grads.buckets:
        b.group.allreduce_(b.flat)
    for p in grads.sp_params:
        grads.topo.tp_comm.allreduce_(p.grad)


@contextmanager
def reduction_override(mode: str | None):
    """Benchmarks only: replace ``GradBuffers.reduce`` by one blocking all-reduce per
    parameter (``per-parameter``) or per bucket (``blocking``)."""
    from ..parallel.data import GradBuffers

    saved = GradBuffers.reduce
    if mode == "per-parameter":
        GradBuffers.reduce = GradBuffers.reduce_per_parameter
    elif mode == "blocking":
        GradBuffers.reduce = _reduce_blocking
    try:
        yield
    finally:
        GradBuffers.reduce = saved


def train_once(world, sub, overrides, mode, size) -> dict | None:
    """Train on ``sub`` (the world or node 0's ranks; the others sleep until rank 0 wakes
    them). Returns rank 0's steps: step seconds, exposed comm seconds, losses."""
    import time

    import torch

    from .. import comm
    from ..train import train
    from .common import train_config

    cfg = train_config(size, *MODEL[size], *overrides)
    out = None
    if sub is not None:
        scratch = sub.bcast_obj(tempfile.mkdtemp(prefix="hpct-cl-") if sub.rank == 0 else None)
        with reduction_override(mode):
            train(cfg, scratch, sub)
        if sub.rank == 0:
            recs = [json.loads(x) for x in (Path(scratch) / "metrics.jsonl").read_text()
                    .splitlines()]
            out = {"step_s": [r["step_time_s"] for r in recs],
                   "comm_s": [r["comm_s"] for r in recs], "losses": [r["loss"] for r in recs]}
            shutil.rmtree(scratch, ignore_errors=True)
    # Wake idle ranks without a spinning collective (they would steal the 2 ranks' CPUs).
    flag = torch.zeros(1)
    if world.rank == 0:
        comm.wait_all([world.isend(flag, r) for r in range(1, world.size)])
    else:
        h = world.irecv(flag, 0)
        while not h.test():
            time.sleep(0.02)
    return out


def main(argv=None) -> int:
    import argparse

    from .. import comm

    p = argparse.ArgumentParser(prog="python -m hpctrain.bench.cluster")
    p.add_argument("--size", default="tiny")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    world = comm.world()
    node0 = comm.split(world, int(world.rank < 2), world.rank, "bench-node0")
    todo = variants(args.size)
    samples = {k: [] for k in todo}
    names = list(todo)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            n, overrides, mode = todo[name]
            sub = world if n == 4 else (node0 if world.rank < 2 else None)
            res = train_once(world, sub, overrides, mode, args.size)
            if world.rank == 0:
                samples[name].append(res)
                print(f"[cluster] {name}: {res['step_s']}", flush=True)
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(samples))
    return 0


# -- driver side (hpctrain bench, one rank outside the cluster) --------------------------------
def _env() -> dict:
    """This process's environment without the MPI job it runs in (the cluster's mpirun is a
    new job), plus the settings every hpctrain launch uses."""
    from ..cli.bench import MPI_ENV

    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "ORTE_"))}
    return {**keep, **MPI_ENV}


def launch(size: str, repeats: int, out: Path) -> str:
    """Make the cluster, run :func:`main` on 4 ranks over it, remove it; returns the log."""
    name = f"b{os.getpid() % 10**6}"
    env = _env()
    subprocess.run([str(SCRIPT), "up", name, "2", "2", RATE], check=True, env=env,
                   capture_output=True, text=True)
    try:
        proc = subprocess.run(
            [str(SCRIPT), "mpirun", name, "-n", "4", "--oversubscribe", sys.executable, "-m",
             "mpi4py", "-m", "hpctrain.bench.cluster", "--size", size, "--repeats",
             str(repeats), "--out", str(out)], env=env, capture_output=True, text=True,
            timeout=1500, cwd=SCRIPT.parents[1])
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"cluster mpirun exited {proc.returncode}: {log[-2000:]}")
        return log
    finally:
        subprocess.run([str(SCRIPT), "down", name], env=env, capture_output=True)


def _steady(xs: list) -> list:
    return xs[1:] if len(xs) > 1 else xs


def _share(sample: dict) -> float:
    """Exposed communication / step time over the steady steps (rank 0)."""
    comm_s = sum(sum(c.values()) for c in _steady(sample["comm_s"]))
    return comm_s / sum(_steady(sample["step_s"]))


def run(world, size: str, repeats: int) -> dict:
    """Drive the cluster from world rank 0 (world size 1); see the module docstring."""
    out = result("cluster", world, size, repeats,
                 f"2 simulated nodes x 2 ranks, inter-node link {RATE} (tc tbf, no added "
                 f"delay), same model and global batch: {' '.join(MODEL[size])}")
    check = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        out["notes"].append(f"skipped: no simulated cluster here ({check.stderr.strip()})")
        return out
    with tempfile.TemporaryDirectory(prefix="hpct-cluster-bench-") as d:
        launch(size, repeats, Path(d) / "samples.json")
        samples = json.loads((Path(d) / "samples.json").read_text())
    step = {k: median([median(_steady(s["step_s"])) for s in v]) for k, v in samples.items()}
    share = {k: median([_share(s) for s in v]) for k, v in samples.items()}
    out["rows"] = [row(k, [median(_steady(s["step_s"])) for s in v]) for k, v in
                   samples.items()]
    best = min((k for k in step if k.startswith(("b:", "c: bucketed"))), key=step.get)
    one = step["d: 1 node x 2 ranks"]
    out["ratios"] = [
        ratio("a: naive / auto", step["a: tp across the link (naive)"]
              / step["a: tp inside nodes (auto)"], ">= 1.1"),
        ratio("b: flat / hierarchical (both blocking)", step["b: dp flat (blocking buckets)"]
              / step["b: dp hierarchical"], ">= 1.0"),
        ratio("c: per-parameter / overlapped", step["c: per-parameter"]
              / step["c: bucketed + overlapped"], ">= 1.2"),
        ratio(f"d: efficiency 1->2 nodes ({best[3:]})", one * 2 / (step[best] * 4), ">= 0.5"),
        ratio("d: efficiency, per-parameter", one * 2 / (step["c: per-parameter"] * 4),
              ">= 0.5"),
    ]
    for k in samples:
        axes = {}
        for s in samples[k]:
            for c in _steady(s["comm_s"]):
                for a, v in c.items():
                    axes[a] = axes.get(a, 0.0) + v
        top = ", ".join(f"{a} {v / max(sum(axes.values()), 1e-12):.0%}"
                        for a, v in sorted(axes.items(), key=lambda x: -x[1])[:3])
        out["notes"].append(f"{k}: step {step[k] * 1e3:.0f} ms, exposed communication "
                            f"{share[k]:.0%} of the step ({top})")
    out["table"] = [{"variant": k, "step_s": step[k], "comm_share": share[k]} for k in step]
    out["check"] = same_losses({k: v[0]["losses"] for k, v in samples.items()}, tol=1e-4)
    out["check"]["what"] = "per-step losses of every variant (same model, same global batch)"
    return out


if __name__ == "__main__":
    sys.exit(main())
