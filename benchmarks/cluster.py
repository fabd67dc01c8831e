"""Multi-node: the communication design, not the rank count, decides speed.

``python -m benchmarks --only cluster`` makes 2 simulated nodes x 2 ranks on this machine
(``scripts/cluster.sh``: network namespaces, one veth link per node shaped to
``RATE`` (``HPCTRAIN_CLUSTER_RATE``, default 200mbit) by a token bucket, Open MPI over
TCP between nodes, shared memory within) and runs ONE ``mpirun`` over them
(:mod:`benchmarks.cluster_worker`) in which every variant trains the same model and global
batch with ``hpctrain.train.train``, interleaved repeat by repeat:

(a) tp inside nodes (``placement=auto``) vs tp across the link (``naive``), dp=2 x tp=2;
(b) flat vs hierarchical dp reduction, dp=4; (c) bucketed + overlapped vs one blocking
all-reduce per parameter (``experimental.reduction=per-parameter``), dp=4; (d) 1 node x 2 ranks
(the node-0 ranks alone, node 1 idle and sleeping) vs 2 nodes x 2 ranks: strong-scaling
efficiency; and a sweep of bucket size x overlap on the slow link. Each with the share of
the step spent in exposed communication (``comm_s`` of metrics.jsonl, rank 0).

This module is the driver: registered at world size 1, that rank runs outside the simulated
cluster (:func:`run`: make the cluster, launch the worker's mpirun, remove the cluster) and
turns the samples into the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hpctrain.job.launch import ROOT, cluster_program, command, detect, nested_env

from .cluster_worker import MODEL
from .common import median, ratio, result, row, same_losses

RANKS = (1,)
# The link: this machine computes ~10 GFLOP/s, so 200 Mbit/s gives about the FLOP-per-bit
# balance of a GPU node on a 200-400 Gbit/s network (1 Gbit/s here is relatively faster).
RATE = os.environ.get("HPCTRAIN_CLUSTER_RATE", "200mbit")
SCRIPT = ROOT / "scripts" / "cluster.sh"



def launch(size: str, repeats: int, out: Path, worker: str = "cluster_worker") -> str:
    """Make the cluster, run ``worker`` (a module of this package) on 4 ranks over it,
    remove it; returns the log."""
    name = f"b{os.getpid() % 10**6}"
    env = nested_env()
    subprocess.run([str(SCRIPT), "up", name, "2", "2", RATE], check=True, env=env,
                   capture_output=True, text=True)
    try:
        launcher = detect().with_program(cluster_program(str(SCRIPT), name))
        proc = subprocess.run(
            command(4, sys.executable, "-m", "mpi4py", "-m", f"{__package__}.{worker}",
                    "--size", size, "--repeats", str(repeats), "--out", str(out),
                    launcher=launcher), env=env, capture_output=True, text=True,
            timeout=1500, cwd=ROOT)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"cluster mpirun exited {proc.returncode}: {log[-2000:]}")
        return log
    finally:
        subprocess.run([str(SCRIPT), "down", name], env=env, capture_output=True)


def begin(name: str, world, size: str, repeats: int, what: str,
          worker: str) -> tuple[dict, dict | None]:
    """The result of part ``name`` (``what`` after the link) and each variant's samples from
    ``worker`` run over a fresh simulated cluster, or None (with a note in the result)
    where this machine cannot make one."""
    out = result(name, world, size, repeats, f"2 simulated nodes x 2 ranks, inter-node link "
                 f"{RATE} (tc tbf, no added delay), {what}: {' '.join(MODEL[size])}")
    check = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        out["notes"].append(f"skipped: no simulated cluster here ({check.stderr.strip()})")
        return out, None
    with tempfile.TemporaryDirectory(prefix="hpct-cluster-bench-") as d:
        launch(size, repeats, Path(d) / "samples.json", worker)
        return out, json.loads((Path(d) / "samples.json").read_text())


def _steady(xs: list) -> list:
    return xs[1:] if len(xs) > 1 else xs


def _share(sample: dict) -> float:
    """Exposed communication / step time over the steady steps (rank 0)."""
    comm_s = sum(sum(c.values()) for c in _steady(sample["comm_s"]))
    return comm_s / sum(_steady(sample["step_s"]))


def _ratios(step: dict, notes: dict) -> list[dict]:
    """The comparisons, each with its measured reason (``why``, shown where it misses): the
    step time and exposed-communication share of the variants it compares."""
    best = min((k for k in step if k.startswith(("b:", "c: bucketed"))), key=step.get)
    one = step["d: 1 node x 2 ranks"]
    a_auto, a_naive = "a: tp inside nodes (auto)", "a: tp across the link (naive)"
    b_flat, b_hier = "b: dp flat (blocking buckets)", "b: dp hierarchical"
    c_pp, c_ov = "c: per-parameter", "c: bucketed + overlapped"
    d_one = "d: 1 node x 2 ranks"
    out = [
        (ratio("a: naive / auto", step[a_naive] / step[a_auto], ">= 1.1"), (a_naive, a_auto)),
        (ratio("b: flat / hierarchical (both blocking)", step[b_flat] / step[b_hier],
               ">= 1.0"), (b_flat, b_hier)),
        (ratio("c: per-parameter / overlapped", step[c_pp] / step[c_ov], ">= 1.2"),
         (c_pp, c_ov)),
        (ratio(f"d: efficiency 1->2 nodes ({best[3:]})", one * 2 / (step[best] * 4), ">= 0.5"),
         (best, d_one)),
        (ratio("d: efficiency, per-parameter", one * 2 / (step[c_pp] * 4), ">= 0.5"),
         (c_pp, d_one)),
    ]
    for q, names in out:
        q["why"] = "; ".join(notes[n] for n in names if n in notes)
    return [q for q, _ in out]


def _comm_note(name: str, runs: list[dict], step_s: float, share: float) -> str:
    """One variant's step time, exposed communication share and its top 3 axes."""
    axes: dict[str, float] = {}
    for s in runs:
        for c in _steady(s["comm_s"]):
            for a, v in c.items():
                axes[a] = axes.get(a, 0.0) + v
    top = ", ".join(f"{a} {v / max(sum(axes.values()), 1e-12):.0%}"
                    for a, v in sorted(axes.items(), key=lambda x: -x[1])[:3])
    return (f"{name}: step {step_s * 1e3:.0f} ms, exposed communication "
            f"{share:.0%} of the step ({top})")


def run(world, size: str, repeats: int) -> dict:
    """Drive the cluster from world rank 0 (world size 1); see the module docstring."""
    out, samples = begin("cluster", world, size, repeats, "same model and global batch",
                         "cluster_worker")
    if samples is None:
        return out
    step = {k: median([median(_steady(s["step_s"])) for s in v]) for k, v in samples.items()}
    share = {k: median([_share(s) for s in v]) for k, v in samples.items()}
    out["rows"] = [row(k, [median(_steady(s["step_s"])) for s in v]) for k, v in
                   samples.items()]
    notes = {k: _comm_note(k, v, step[k], share[k]) for k, v in samples.items()}
    out["ratios"] = _ratios(step, notes)
    out["notes"] += list(notes.values())
    out["table"] = [{"variant": k, "step_s": step[k], "comm_share": share[k]} for k in step]
    out["check"] = same_losses({k: v[0]["losses"] for k, v in samples.items()}, tol=1e-4)
    out["check"]["what"] = "per-step losses of every variant (same model, same global batch)"
    return out
