"""The ranks inside the simulated cluster of :mod:`benchmarks.cluster`: ONE ``mpirun`` of 4
ranks over 2 simulated nodes x 2 ranks, started by that driver,

    scripts/cluster.sh mpirun NAME -n 4 python -m mpi4py \
        -m benchmarks.cluster_worker --size tiny --repeats 1 --out SAMPLES.json

in which every variant of :data:`VARIANTS` trains the same model and global batch with
``hpctrain.train.train``, interleaved repeat by repeat; rank 0 writes each variant's steps
(step seconds, exposed communication seconds per axis, losses) to ``--out``.

How gradients are summed is the config key ``experimental.reduction`` (``bucketed``: one blocking
all-reduce per bucket, in order; ``bucketed-nonblocking``: every bucket posted, then waited
for; ``per-parameter``: one blocking all-reduce per parameter), set like any other override.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

MODEL = {  # float32; at small 14 MB of gradients in 67 tensors, and tp activations of
    # 12 MB per rank per step (512 tokens x 192 x 4 B x 4 all-reduces x 8 layers / tp 2)
    "tiny": ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "train.steps=2",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=16"],
    "small": ["model.n_layers=8", "model.d_model=192", "model.n_heads=4", "train.steps=4",
              "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=128"],
}
DP4 = ["topology.dp=4"]
VARIANTS = {  # name -> (ranks used: 2 = node 0 only, overrides, experimental.reduction or None)
    # (a) with blocking buckets on both sides: placement alone differs (see b).
    "a: tp inside nodes (auto)": (4, ["topology.dp=2", "topology.tp=2"], "bucketed"),
    "a: tp across the link (naive)": (4, ["topology.dp=2", "topology.tp=2",
                                          "experimental.placement=naive"], "bucketed"),
    "b: dp flat (nonblocking buckets)": (4, DP4, "bucketed-nonblocking"),
    "b: dp flat (blocking buckets)": (4, DP4, "bucketed"),
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


def overrides_of(variant: tuple, size: str) -> list[str]:
    """The ``--set``-style overrides of one variant: model, layout and reduction."""
    _, overrides, reduction = variant
    chosen = [f'experimental.reduction="{reduction}"'] if reduction else []
    if "optim.overlap=true" not in overrides:  # overlap only where a variant asks for it
        chosen.append("optim.overlap_across_nodes=false")
    return [*MODEL[size], *overrides, *chosen]


def _read_steps(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": [r["step_time_s"] for r in recs],
            "comm_s": [r["comm_s"] for r in recs], "losses": [r["loss"] for r in recs]}


def train_once(world, sub, overrides: list[str], size: str) -> dict | None:
    """Train on ``sub`` (the world or node 0's ranks; the others sleep until rank 0 wakes
    them). Returns rank 0's steps: step seconds, exposed comm seconds, losses."""
    import torch

    from hpctrain import comm
    from hpctrain.train import train

    from .common import train_config

    cfg = train_config(size, *overrides)
    out = None
    if sub is not None:
        scratch = sub.bcast_obj(tempfile.mkdtemp(prefix="hpct-cl-") if sub.rank == 0 else None)
        train(cfg, scratch, sub)
        if sub.rank == 0:
            out = _read_steps(Path(scratch))
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


def worker_args(prog: str, argv=None):
    """``--size``, ``--repeats``, ``--out`` of a worker inside the simulated cluster."""
    import argparse

    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--size", default="tiny")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def interleave(world, names: list[str], repeats: int, one, out: str, tag: str,
               extra: dict | None = None) -> None:
    """``one(name)`` for every variant, ``repeats`` times, the order reversed every other
    repeat; rank 0 writes each variant's samples to ``out`` (JSON), with ``extra``'s keys.
    Collective when ``one`` is."""
    samples: dict[str, list] = {k: [] for k in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            res = one(name)
            if world.rank == 0:
                samples[name].append(res)
                print(f"[{tag}] {name}: {res['step_s']}", flush=True)
    if world.rank == 0:
        Path(out).write_text(json.dumps({**samples, **(extra or {})}))


def main(argv=None) -> int:
    from hpctrain import comm

    args = worker_args("python -m benchmarks.cluster_worker", argv)
    world = comm.world()
    node0 = comm.split(world, int(world.rank < 2), world.rank, "bench-node0")
    todo = variants(args.size)

    def one(name: str) -> dict | None:
        n = todo[name][0]
        sub = world if n == 4 else (node0 if world.rank < 2 else None)
        return train_once(world, sub, overrides_of(todo[name], args.size), args.size)

    interleave(world, list(todo), args.repeats, one, args.out, "cluster")
    return 0


if __name__ == "__main__":
    from hpctrain.__main__ import finish

    finish(main())
