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
plan's activations. ``python -m benchmarks.context_kinds [--size small] [--repeats 5]``
runs the part and prints the Markdown table with the machine load.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .common import median, pairs_of, result, row, same_losses
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
    res.update(table=table, check=same_losses(losses, tol=1e-4))
    res["notes"] += [NOTE]
    return res


NOTE = ("hybrid: topology.cp_ulysses=2 (cp=2: one Ulysses pair, no ring); peak = parameters "
        "+ gradients + optimizer state + saved activations (hpctrain.telemetry.Meter), max "
        "over ranks")
COLUMNS = ("cp", "kind", "step time (ms)", "vs ring [spread]", "peak / rank (KiB)",
           "activations (KiB)", "plan (KiB)", "cp bytes / step (KiB)", "cp exposed (ms)")


def _cells(r: dict) -> list[str]:
    lo, hi = r["vs_ring_spread"]
    return [str(r["cp"]), r["kind"], f"{1000 * r['step_s']:.0f}",
            f"{r['vs_ring']:.2f} [{lo:.2f}-{hi:.2f}]",
            *(f"{r[k] / 1024:.0f}" for k in ("peak_bytes", "act_bytes", "plan_act_bytes",
                                            "cp_bytes")), f"{1000 * r['cp_exposed_s']:.0f}"]


def markdown(tables: list[list[dict]]) -> list[str]:
    """One row per (cp, kind)."""
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + [
        "| " + " | ".join(_cells(r)) + " |" for rows in tables for r in rows]


def main(argv=None) -> int:
    """Run the part through ``python -m benchmarks`` (cp = 2 and 4, one mpirun each) and
    print its Markdown table with the machine load of each part."""
    import argparse

    from .driver import main as bench

    p = argparse.ArgumentParser(prog="python -m benchmarks.context_kinds")
    p.add_argument("--size", default="small")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        status = bench(["--only", "context_kinds", "--size", args.size, "--repeats",
                        str(args.repeats), "--out", out])
        results = json.loads((Path(out) / "bench.json").read_text())["results"]
    parts = [r for r in results if "table" in r]
    print("\n".join(markdown([r["table"] for r in parts])))
    for r in parts:
        print(f"cp={r['ranks']}: load average before {r['load']['before']}, after "
              f"{r['load']['after']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
