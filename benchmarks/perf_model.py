"""The cost model against real runs on this machine: ``python -m benchmarks.perf_model``.

1. ``hpctrain plan --calibrate`` under ``mpirun -n 2`` writes
   ``share/clusters/this-machine.toml`` (and, with ``--two-node``, under 2 simulated nodes x 2
   ranks of ``scripts/cluster.sh`` at ``RATE``, ``this-machine-2node.toml``);
2. every layout of :data:`LAYOUTS` (:data:`TWO_NODE` on the simulated nodes) trains
   :data:`MODEL` for a few steps through the real CLI, repeated and interleaved; the
   measured step time is the median over the rounds of each run's median ``step_time_s``
   (first steps dropped; the description is the median of the rounds' calibrations: see
   :func:`run_table`);
3. the table (measured, predicted, error, load average) is printed and written to
   ``share/perf/calibration-runs.json``, which ``tests/unit/test_perf.py`` holds to 25 %
   (``--markdown``: also as the table of docs/results.md; ``--predict-only``:
   the stored runs with this model's predictions, no runs).

The whole run: ``python -m benchmarks.perf_model --repeats 5 --two-node --markdown``
(about 20 minutes on this machine when it is quiet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpctrain.job.launch import ROOT, cluster_program, command, detect, nested_env

PY = sys.executable  # the venv running this (its mpi4py picks the launcher)
CFG = "share/configs/tiny.toml"
MODEL = ('model.dtype="float32"', "model.d_model=64", "model.n_heads=8", "model.d_ff=256",
         "train.seq_len=64", "train.global_batch_size=16", "train.steps=14",
         "checkpoint.save_final=false", "telemetry.watchdog_s=0")
LAYOUTS = {  # name -> (ranks, overrides): at most 2 ranks, one per core
    "1 rank": (1, ()),
    "dp=2": (2, ("topology.dp=2",)),
    "dp=2 zero=2": (2, ("topology.dp=2", "optim.zero=2")),
    "tp=2": (2, ("topology.tp=2",)),
    "tp=2 sp": (2, ("topology.tp=2", "topology.sequence_parallel=true")),
    "pp=2 1f1b": (2, ("topology.pp=2", "schedule.kind=1f1b")),
    "pp=2 gpipe mbs=2": (2, ("topology.pp=2", "schedule.kind=gpipe",
                             "train.micro_batch_size=2")),
    "pp=2 zb-h1": (2, ("topology.pp=2", "schedule.kind=zb-h1")),
    "cp=2": (2, ("topology.cp=2",)),
    "dp=2 zero=3": (2, ("topology.dp=2", "optim.zero=3")),
    "dp=2 overlap": (2, ("topology.dp=2", "optim.overlap=true")),
}
TWO_NODE = {  # 2 simulated nodes x 2 ranks (4 ranks on this machine's 2 cores)
    "2 nodes dp=4": (4, ("topology.dp=4",)),
    "2 nodes dp=2 tp=2": (4, ("topology.dp=2", "topology.tp=2")),
    "2 nodes dp=2 pp=2": (4, ("topology.dp=2", "topology.pp=2")),
}
RATE = os.environ.get("HPCTRAIN_CLUSTER_RATE", "200mbit")
OUT = ROOT / "share" / "perf" / "calibration-runs.json"



def _launch(n: int, args: list[str], cluster: str | None) -> list[str]:
    launcher = detect() if cluster is None else detect().with_program(
        cluster_program(str(ROOT / "scripts" / "cluster.sh"), cluster))
    return command(n, PY, "-m", "mpi4py", "-m", "hpctrain", *args, launcher=launcher,
                   oversubscribe=False)


def calibrate(n: int, out: Path, cluster: str | None) -> None:
    sets = [x for kv in MODEL for x in ("--set", kv)]
    cmd = _launch(n, ["plan", CFG, "--world-size", str(n), *sets, "--calibrate", str(out)],
                  cluster)
    subprocess.run(cmd, check=True, env=nested_env(), cwd=ROOT, stdout=subprocess.DEVNULL)


def measure(n: int, layout: tuple, cluster: str | None) -> float:
    """One run's median step time (steps 3..), seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [x for kv in (*MODEL, *layout) for x in ("--set", kv)]
        cmd = _launch(n, ["train", CFG, "--run-dir", f"{tmp}/run", *sets], cluster)
        subprocess.run(cmd, check=True, env=nested_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().split(
            "\n") if x.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > 2]
    return statistics.median(times)


def median_cluster(paths: list[Path], out: Path) -> None:
    """One description from several calibrations: the median of every measured number (a
    rate, a latency, an overhead), as the runs are compared at their median round. The
    machine is shared and its speed changes within minutes; the median of a number over
    the rounds, like that of a layout's step, is what a typical round sees."""
    from hpctrain.planner.cluster import dumps, load

    cs = [load(str(p)) for p in paths]
    med = lambda get: statistics.median(get(c) for c in cs)  # noqa: E731
    first = cs[-1]
    link = lambda level: type(first.intra)(  # noqa: E731
        med(lambda c: getattr(c, level).latency), med(lambda c: getattr(c, level).bandwidth))
    dtype = next(iter(first.peak_flops))
    merged = first.__class__(**{
        **first.__dict__,
        **{k: med(lambda c, k=k: getattr(c, k)) for k in (
            "efficiency", "overhead_s", "pass_overhead_s", "hook_overhead_s",
            "ring_overhead_s", "step_overhead_s", "call_overhead_s", "post_overhead_s",
            "compute_share",
            "split_b", "split_w")},
        "peak_flops": {dtype: med(lambda c: c.peak_flops[dtype])}, "name": out.stem,
        "intra": link("intra"), "inter": link("inter"),
        "source": first.source + f"; median of {len(cs)} calibrations, one before each "
                                 "round of runs",
        "extra": {**first.extra, "load_average": "; ".join(c.extra["load_average"]
                                                           for c in cs)}})
    out.write_text(dumps(merged))


def run_table(layouts: dict, repeats: int, cluster: str | None, description: str) -> list:
    """Rounds of (calibrate, every layout once): calibration and runs under the same load.
    Measured is each layout's median round and the description the median of the
    calibrations: this host's other tenants slow whole runs at random (measured
    2026-12-01: one rank's step 174-283 ms in six back-to-back runs; a 1F1B run at 464 ms
    between runs at 141-220 ms), and one round's outlier must not decide a row."""
    samples: dict[str, list[float]] = {k: [] for k in layouts}
    loads, cals = [], []
    n_cal = max(n for n, _ in layouts.values())
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            cals.append(Path(tmp) / f"cal{r}.toml")
            calibrate(n_cal, cals[-1], cluster)
            for name, (n, layout) in layouts.items():
                loads.append(os.getloadavg()[0])
                samples[name].append(measure(n, layout, cluster))
        median_cluster(cals, ROOT / "share" / "clusters" / description)
    return [{"layout": name, "ranks": n, "overrides": list(layout),
             "cluster": description, "measured_s": statistics.median(samples[name]),
             "samples_s": samples[name],
             "load_average": [min(loads), max(loads)]}
            for name, (n, layout) in layouts.items()]


def predict_rows(rows: list) -> list:
    from hpctrain.config import load
    from hpctrain.planner.cluster import load as load_cluster
    from hpctrain.planner.cost import predict

    for r in rows:
        cfg = load(ROOT / CFG, [*MODEL, *r["overrides"]])
        p = predict(cfg, load_cluster(str(ROOT / "share" / "clusters" / r["cluster"])))
        r["predicted_s"] = p.step_s - p.parts["checkpoint"]
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
    return rows


TOLERANCE = 0.25


def markdown(data: dict) -> str:
    """The calibration table of docs/results.md."""
    out = ["| layout | ranks | description | measured s, median of "
           f"{data.get('repeats', 2)} rounds (min-max) | predicted s | error | load average "
           "(1 min) during the rounds | held |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lo, hi = min(r["samples_s"]), max(r["samples_s"])
        la, lb = r["load_average"]
        out.append(f"| {r['layout']} | {r['ranks']} | `{r['cluster']}` | "
                   f"{r['measured_s']:.3f} ({lo:.3f}-{hi:.3f}) | {r['predicted_s']:.3f} | "
                   f"{100 * r['error']:+.0f}% | {la:.1f}-{lb:.1f} | "
                   f"{'yes' if abs(r['error']) <= TOLERANCE else 'no'} |")
    held = sum(abs(r["error"]) <= TOLERANCE for r in data["rows"])
    out.append(f"\n{held} of {len(data['rows'])} rows within {100 * TOLERANCE:.0f} %"
               f" ({data['date']}, {data.get('duration_s', 0) / 60:.1f} min; "
               f"`uptime` at the end: `{data.get('uptime', '')}`).")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--two-node", action="store_true", help="also the simulated 2 nodes")
    ap.add_argument("--predict-only", action="store_true",
                    help="recompute the predictions of the stored table (no runs) and rewrite it")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as markdown for docs/results.md")
    a = ap.parse_args(argv)
    if a.predict_only:
        data = json.loads(OUT.read_text())
        data["rows"] = predict_rows(data["rows"])
    else:
        t0 = time.monotonic()
        data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "model": list(MODEL), "config": CFG, "repeats": a.repeats, "rows": []}
        data["rows"] += run_table(LAYOUTS, a.repeats, None, "this-machine.toml")
        if a.two_node:
            data["rows"] += two_node(a.repeats)
        data["rows"] = predict_rows(data["rows"])
        data["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        data["duration_s"] = round(time.monotonic() - t0)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    for r in data["rows"]:
        print(f"{r['layout']:<22} measured {r['measured_s']:.4f} s  predicted "
              f"{r['predicted_s']:.4f} s  error {100 * r['error']:+.1f}%  load "
              f"{r['load_average']}")
    missed = [r["layout"] for r in data["rows"] if abs(r["error"]) > TOLERANCE]
    print(f"written {OUT.relative_to(ROOT)}; outside {100 * TOLERANCE:.0f} %: "
          f"{', '.join(missed) or 'none'} (tests/unit/test_perf.py: MISSED must name exactly "
          "these, with the reason)")
    if a.markdown:
        print(markdown(data))
    return 0


def two_node(repeats: int) -> list:
    script = str(ROOT / "scripts" / "cluster.sh")
    subprocess.run([script, "up", "perf", "2", "2", RATE], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        return run_table(TWO_NODE, repeats, "perf", "this-machine-2node.toml")
    finally:
        subprocess.run([script, "down", "perf"], check=False)


if __name__ == "__main__":
    sys.exit(main())
