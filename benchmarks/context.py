"""Activation memory per rank at a fixed sequence length under context parallelism.

``python -m benchmarks.context [--size small] [--ranks 1,2,4] [--seq-len 256] [--kinds
ring,ulysses,hybrid] [--kv-heads 2]`` launches one mpirun per cp size and kind (``topology.cp =
ranks``, ``topology.cp_kind``, the llama form: rotary, 4 query heads on ``--kv-heads`` kv
heads) and prints a Markdown table: the measured saved activations per rank
(``mem_activations`` of :class:`hpctrain.telemetry.Meter`, max over ranks, the maximum over
the step of what autograd saves), the plan's estimate (``planner.memory.estimate``),
their ratio to cp=1, the measured peak (``mem_peak``: parameters, gradients, optimizer
state and activations, max over ranks), the step time and the cp axis's bytes and exposed
seconds per step (``comm_bytes``/``comm_s`` of axis ``cp``), one microbatch of 4 sequences
per step. Losses must agree across cp sizes (float32, 1e-4).
Not in ``python -m benchmarks``: a sweep over launches, like ``benchmarks.memory``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hpctrain.job.launch import command, launch_env, with_checkout

from .common import median, scratch_dir, train_config


def run(world, size: str, seq_len: int, steps: int = 3, kind: str = "ring",
        kv_heads: int = 2, overrides: tuple = ()) -> dict:
    """Train ``size`` at ``topology.cp = world.size`` with ``topology.cp_kind = kind`` (one
    microbatch per step; ``overrides``: more ``--set`` values); rank 0 returns the row.
    Collective."""
    from hpctrain.planner.memory import estimate
    from hpctrain.train import train

    cp = world.size
    cfg = train_config(size, 'model.arch="llama"', f"model.n_kv_heads={kv_heads}",
                       f"topology.cp={cp}", f"topology.cp_kind={kind}", f"train.seq_len={seq_len}",
                       f"train.steps={steps}", "train.global_batch_size=4",
                       "train.micro_batch_size=4", *overrides)
    with scratch_dir(world) as scratch:
        res = train(cfg, scratch, world)
        lines = []
        if world.rank == 0:
            lines = [json.loads(x) for x in (Path(scratch) / "metrics.jsonl").read_text()
                     .splitlines()]
    lines = world.bcast_obj(lines)
    act = world.allreduce(float(lines[-1]["mem_activations"]) if lines else 0.0, "max")
    peak = world.allreduce(float(lines[-1].get("mem_peak", 0)) if lines else 0.0, "max")
    return {"cp": cp, "kind": kind if cp > 1 else "-", "seq_len": seq_len, "act_bytes": act,
            "peak_bytes": peak,
            "plan_act_bytes": estimate(cfg).activations,
            "step_s": median([m["step_time_s"] for m in lines[1:]]),
            "cp_bytes": median([m["comm_bytes"].get("cp", 0) for m in lines[1:]]),
            "cp_exposed_s": median([m["comm_s"].get("cp", 0.0) for m in lines[1:]]),
            "losses": list(res.losses)}


def markdown(rows: list[dict]) -> list[str]:
    kib, base = 1024.0, rows[0]
    out = ["| cp | kind | activations / rank (KiB) | vs cp=1 | plan (KiB) | plan / measured | "
           "peak (KiB) | step time (ms) | cp bytes / step (KiB) | cp exposed (ms) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['cp']} | {r['kind']} | {r['act_bytes'] / kib:.0f} | "
                   f"{r['act_bytes'] / base['act_bytes']:.3f} | {r['plan_act_bytes'] / kib:.0f} | "
                   f"{r['plan_act_bytes'] / r['act_bytes']:.3f} | "
                   f"{r['peak_bytes'] / kib:.0f} | {1000 * r['step_s']:.0f} | "
                   f"{r['cp_bytes'] / kib:.0f} | {1000 * r['cp_exposed_s']:.0f} |")
    return out


def main(argv=None) -> int:
    import argparse
    import os
    import subprocess

    import numpy as np

    p = argparse.ArgumentParser(prog="python -m benchmarks.context")
    p.add_argument("--size", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kinds", default="ring", help="cp kinds for cp > 1: ring,ulysses,hybrid")
    p.add_argument("--kv-heads", type=int, default=2)
    args = p.parse_args(argv)
    env = with_checkout({**os.environ, **launch_env()})
    rows = []
    with tempfile.TemporaryDirectory() as out:
        runs = [(int(x), k) for x in args.ranks.split(",")
                for k in (args.kinds.split(",") if int(x) > 1 else ["ring"])]
        for n, kind in runs:
            code = ("import json; from hpctrain import comm; "
                    "from benchmarks.context import run; "
                    f"r = run(comm.world(), {args.size!r}, {args.seq_len}, {args.steps}, "
                    f"{kind!r}, {args.kv_heads}); "
                    f"comm.world().rank == 0 and json.dump(r, open('{out}/c{n}{kind}.json', "
                    "'w'))")
            subprocess.run(command(n, sys.executable, "-m", "mpi4py", "-c", code), check=True,
                           env=env)
            rows.append(json.loads(Path(f"{out}/c{n}{kind}.json").read_text()))
    ref = np.asarray(rows[0]["losses"])
    for r in rows[1:]:
        err = float(np.max(np.abs(np.asarray(r["losses"]) - ref) / np.abs(ref)))
        if err > 1e-4:
            print(f"cp={r['cp']}: losses differ from cp={rows[0]['cp']} by {err:.2e}",
                  file=sys.stderr)
    print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
