"""Memory per rank and step time for ZeRO 0, 1, 2, 3 at this world size (dp = world size).

``run(world, size, repeats)`` follows the :mod:`benchmarks` protocol (collective over
``world``; rank 0's return value is the result); ``python -m benchmarks`` runs it at dp = 1,
2, 4 (``"memory": (1, 2, 4)`` in ``BENCHES``). ``python -m benchmarks.memory`` (from the
repository root) runs the whole sweep and prints the README's Markdown table.

Peak memory is the measured peak of :class:`hpctrain.telemetry.Meter` (parameters + gradient
storage + optimizer state + saved activations), the maximum over ranks; the plan's estimate
sits beside it. Step time is the median over steps 2.. of every repeat (step 1 warms up);
repeats interleave the levels (zero 0, 1, 2, 3, then again), so a noisy machine slows them
alike. ``--levels 1,3`` compares two of them (the cost of ZeRO-3's gathers).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hpctrain.job.launch import command, launch_env, with_checkout

from .common import median, result, row, same_losses, scratch_dir, train_config

LEVELS = (0, 1, 2, 3)


def _train(cfg, world) -> tuple[list[float], list[float], dict]:
    """(step seconds, losses, this rank's last mem_* metrics + max over ranks). Collective."""
    from hpctrain.train import train

    times, mem = [], {}
    with scratch_dir(world) as scratch:
        res = train(cfg, scratch, world)
        if world.rank == 0:
            lines = [json.loads(x) for x in (Path(scratch) / "metrics.jsonl").read_text()
                     .splitlines()]
            times = [m["step_time_s"] for m in lines]
            mem = {k: v for k, v in lines[-1].items() if k.startswith("mem_")}
    times, mem = world.bcast_obj((times, mem))
    mem["mem_peak_max"] = world.allreduce(float(mem.get("mem_peak", 0)), "max")
    return times, list(res.losses), mem


def run(world, size: str, repeats: int, levels=LEVELS, overrides=()) -> dict:
    from hpctrain.planner.memory import estimate

    dp = world.size
    res = result("memory", world, size, repeats,
                 f"ZeRO {'/'.join(map(str, levels))} at dp={dp}: peak memory per rank and "
                 "step time")
    losses, table = {}, []
    samples: dict = {z: [] for z in levels}
    mems: dict = {}
    cfgs = {z: train_config(size, *overrides, f"topology.dp={dp}", f"optim.zero={z}")
            for z in levels}
    for _ in range(repeats):  # interleaved: every level once per repeat
        for z in levels:
            times, losses[f"zero={z}"], mems[z] = _train(cfgs[z], world)
            samples[z] += times[1:]
    for z in levels:
        cfg, mem = cfgs[z], mems[z]
        res["rows"].append(row(f"zero={z} step time", samples[z]))
        table.append({"dp": dp, "zero": z, "step_s": median(samples[z]),
                      "peak_bytes": mem["mem_peak_max"], "estimate_bytes": estimate(cfg).total,
                      "optimizer_bytes": mem["mem_optimizer"], "grad_bytes": mem["mem_grads"],
                      "param_bytes": mem["mem_params"], "act_bytes": mem["mem_activations"],
                      "gathered_bytes": mem.get("mem_params_gathered", 0)})
    res["table"] = table
    res["check"] = same_losses(losses, tol=1e-4)
    res["notes"].append("peak = parameters + gradient storage + optimizer state + saved "
                        "activations (hpctrain.telemetry.Meter), max over ranks")
    return res


def markdown(tables: list[list[dict]]) -> list[str]:
    """One row per (dp, zero): the README's side-by-side table."""
    kib = 1024.0
    out = ["| dp | zero | peak / rank (KiB) | plan (KiB) | parameters (KiB) | of which "
           "gathered (KiB) | optimizer state (KiB) | gradients (KiB) | step time (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for rows in tables:
        for r in rows:
            out.append(f"| {r['dp']} | {r['zero']} | {r['peak_bytes'] / kib:.0f} | "
                       f"{r['estimate_bytes'] / kib:.0f} | {r['param_bytes'] / kib:.0f} | "
                       f"{r.get('gathered_bytes', 0) / kib:.0f} | "
                       f"{r['optimizer_bytes'] / kib:.0f} | "
                       f"{r['grad_bytes'] / kib:.0f} | {1000 * r['step_s']:.0f} |")
    return out


def main(argv=None) -> int:
    """Run the sweep dp = 1, 2, 4 (one mpirun each) and print the Markdown table."""
    import argparse
    import os
    import subprocess

    p = argparse.ArgumentParser(prog="python -m benchmarks.memory")
    p.add_argument("--size", default="small")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--levels", default="0,1,2,3", help="ZeRO levels, e.g. 1,3")
    p.add_argument("--set", action="append", default=[], dest="overrides",
                   help="config override on top of the size preset, e.g. model.n_layers=16")
    args = p.parse_args(argv)
    env = with_checkout({**os.environ, **launch_env()})
    tables = []
    with tempfile.TemporaryDirectory() as out:
        for n in (int(x) for x in args.ranks.split(",")):
            code = ("import json,sys; from hpctrain import comm; "
                    "from benchmarks.memory import run; "
                    f"r = run(comm.world(), {args.size!r}, {args.repeats}, "
                    f"{tuple(int(z) for z in args.levels.split(','))}, "
                    f"{tuple(args.overrides)!r}); "
                    f"comm.world().rank == 0 and json.dump(r, open('{out}/m{n}.json', 'w'))")
            subprocess.run(command(n, sys.executable, "-m", "mpi4py", "-c", code), check=True,
                           env=env)
            res = json.loads(Path(f"{out}/m{n}.json").read_text())
            if not res["check"]["ok"]:
                print(f"dp={n}: zero levels disagree: {res['check']}", file=sys.stderr)
            tables.append(res["table"])
    print("\n".join(markdown(tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
