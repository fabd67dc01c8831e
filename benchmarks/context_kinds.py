"""Ring, Ulysses and hybrid context parallelism side by side at cp = world size: step time
and peak memory per rank on the same model, sequence and global batch.

``run(world, size, repeats)`` follows the :mod:`benchmarks` protocol (collective over
``world``; rank 0's return value is the result); ``python -m benchmarks`` runs it at cp = 2
and 4 (``"context_kinds": (2, 4)`` in ``BENCHES``). Each repeat trains each kind for a few
steps in the same processes (:func:`benchmarks.context.run`: the llama form, 4 query
heads on 4 kv heads so that Ulysses divides at cp = 4, one microbatch of 4 sequences), the
order rotated every repeat; step times are the medians over steps 2.. of all repeats
(step 1 warms up), each kind's step time over the ring's is taken repeat by repeat
(no target: which kind wins depends on the links and the attention's length). The hybrid is
``topology.cp_ulysses = 2``: Ulysses pairs with the ring across them (at cp = 2 a single
pair, no ring: Ulysses through the hybrid's code). Peak memory is the meter's ``mem_peak``
(parameters, gradients, optimizer state, saved activations), max over ranks, beside the
plan's activations. ``python -m benchmarks.context_kinds [--ranks 2,4] [--repeats 3]``
runs the sweep and prints the Markdown table with the machine load.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hpctrain.launch import command, launch_env, with_checkout

from .common import loadavg, median, pairs_of, result, row, same_losses
from .context import run as train_kind

KINDS = ("ring", "ulysses", "hybrid")
SEQ = {"tiny": 64, "small": 256}


def run(world, size: str, repeats: int) -> dict:
    cp, seq_len = world.size, SEQ.get(size, 256)
    res = result("context_kinds", world, size, repeats,
                 f"ring vs Ulysses vs hybrid at cp={cp}: step time and peak memory per rank")
    rows: dict = {k: [] for k in KINDS}
    n = pairs_of(repeats, size)
    for r in range(n):  # interleaved: every kind once per repeat, the order rotated
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:
            more = ("topology.cp_ulysses=2",) if kind == "hybrid" else ()
            rows[kind].append(train_kind(world, size, seq_len, 3, kind, 4, more))
    table, losses = [], {}
    for kind in KINDS:
        step = [x["step_s"] for x in rows[kind]]
        res["rows"].append(row(f"{kind} step time", step))
        last = rows[kind][-1]
        losses[kind] = last["losses"]
        table.append({"cp": cp, "kind": kind, "seq_len": seq_len, "step_s": median(step),
                      "peak_bytes": last["peak_bytes"], "act_bytes": last["act_bytes"],
                      "plan_act_bytes": last["plan_act_bytes"],
                      "cp_bytes": last["cp_bytes"], "cp_exposed_s": median(
                          [x["cp_exposed_s"] for x in rows[kind]])})
    for kind, t in zip(KINDS, table):  # no target: which kind wins depends on the machine
        pairs = [a["step_s"] / b["step_s"] for a, b in zip(rows[kind], rows["ring"])]
        t["vs_ring"], t["vs_ring_spread"] = median(pairs), [min(pairs), max(pairs)]
        res["notes"].append(f"{kind}: step time / ring's {median(pairs):.2f} [{min(pairs):.2f}"
                            f"-{max(pairs):.2f}, {len(pairs)} repeats], peak "
                            f"{t['peak_bytes'] / 2**20:.1f} MiB per rank")
    res["table"] = table
    res["check"] = same_losses(losses, tol=1e-4)
    res["notes"].append("hybrid: topology.cp_ulysses=2 (cp=2: one Ulysses pair, no ring); "
                        "peak = parameters + gradients + optimizer state + saved "
                        "activations (hpctrain.telemetry.Meter), max over ranks")
    return res


def markdown(tables: list[list[dict]]) -> list[str]:
    kib = 1024.0
    out = ["| cp | kind | step time (ms) | vs ring [spread] | peak / rank (KiB) | activations "
           "(KiB) | plan (KiB) | cp bytes / step (KiB) | cp exposed (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for rows in tables:
        for r in rows:
            lo, hi = r["vs_ring_spread"]
            out.append(f"| {r['cp']} | {r['kind']} | {1000 * r['step_s']:.0f} | "
                       f"{r['vs_ring']:.2f} [{lo:.2f}-{hi:.2f}] | "
                       f"{r['peak_bytes'] / kib:.0f} | {r['act_bytes'] / kib:.0f} | "
                       f"{r['plan_act_bytes'] / kib:.0f} | {r['cp_bytes'] / kib:.0f} | "
                       f"{1000 * r['cp_exposed_s']:.0f} |")
    return out


def main(argv=None) -> int:
    """Run the sweep (one mpirun per cp size) and print the Markdown table."""
    import argparse
    import os
    import subprocess

    p = argparse.ArgumentParser(prog="python -m benchmarks.context_kinds")
    p.add_argument("--size", default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", default="2,4")
    args = p.parse_args(argv)
    env = with_checkout({**os.environ, **launch_env()})
    tables, before = [], loadavg()
    with tempfile.TemporaryDirectory() as out:
        for n in (int(x) for x in args.ranks.split(",")):
            code = ("import json; from hpctrain import comm; "
                    "from benchmarks.context_kinds import run; "
                    f"r = run(comm.world(), {args.size!r}, {args.repeats}); "
                    f"comm.world().rank == 0 and json.dump(r, open('{out}/k{n}.json', 'w'))")
            subprocess.run(command(n, sys.executable, "-m", "mpi4py", "-c", code), check=True,
                           env=env)
            res = json.loads(Path(f"{out}/k{n}.json").read_text())
            if not res["check"]["ok"]:
                print(f"cp={n}: the kinds' losses disagree: {res['check']}", file=sys.stderr)
            print("\n".join(f"cp={n}: {note}" for note in res["notes"]))
            tables.append(res["table"])
    print("\n".join(markdown(tables)))
    print(f"load average before {before}, after {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
