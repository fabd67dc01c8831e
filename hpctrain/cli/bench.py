"""``hpctrain bench [--only NAME ...] [--size tiny|small] [--repeats N] --out DIR``

Runs every comparison of :mod:`hpctrain.bench` in one command: each part is launched here
under ``mpirun`` at the world sizes it needs (the user does not start MPI), its result is
collected, and ``DIR/bench.json`` and ``DIR/bench.md`` are written. Exit status 1 when a
part failed or the two sides of a comparison did not compute the same thing; missed speed
targets are reported, not failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMP_NUM_THREADS": "1", "HDF5_USE_FILE_LOCKING": "FALSE"}


def add_arguments(p) -> None:
    from ..bench import BENCHES, SIZES

    p.add_argument("--only", action="append", choices=sorted(BENCHES), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(BENCHES)}")
    p.add_argument("--size", choices=SIZES, default="small",
                   help="tiny: seconds (smoke test); small: the README's numbers")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement")
    p.add_argument("--out", required=True, help="directory for bench.json and bench.md")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mpirun launch")


def launch(names: list[str], ranks: int, args, parts: Path) -> list[dict]:
    """One ``mpirun -n ranks python -m mpi4py -m hpctrain.bench NAME ...`` running every
    benchmark of this world size in turn; their results, ``{"error": ...}`` (with the tail
    of the output) for each that left none."""
    mpirun = shutil.which("mpirun") or "mpirun"
    cmd = [mpirun, "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "mpi4py", "-m",
           "hpctrain.bench", *names, "--size", args.size, "--repeats", str(args.repeats),
           "--out", str(parts)]
    log = parts / f"n{ranks}.log"
    try:
        proc = subprocess.run(cmd, env={**os.environ, **MPI_ENV}, capture_output=True,
                              text=True, timeout=args.timeout)
        log.write_text(proc.stdout + proc.stderr)
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        why = f"exit {proc.returncode}: {tail[-1] if tail else ''}"
    except subprocess.TimeoutExpired:
        why = f"timed out after {args.timeout:.0f} s"
    out = []
    for name in names:
        f = parts / f"{name}_n{ranks}.json"
        out.append(json.loads(f.read_text()) if f.is_file() else
                   {"bench": name, "ranks": ranks, "error": why, "log": str(log)})
    return out


def available(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(f"hpctrain.bench.{name}") is not None


def run(args) -> int:
    from ..bench import BENCHES
    from ..bench.report import write

    if args.repeats < 1:
        print("hpctrain bench: --repeats must be >= 1", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or list(BENCHES)) if available(n)]
    for n in set(args.only or BENCHES) - set(names):
        print(f"[bench] {n}: not in this build, skipped", flush=True)
    results = []
    for ranks in sorted({r for n in names for r in BENCHES[n]}):
        group = [n for n in names if ranks in BENCHES[n]]
        print(f"[bench] {', '.join(group)} on {ranks} rank(s) ...", flush=True)
        for res in launch(group, ranks, args, parts):
            results.append(res)
            print(f"[bench]   {res['bench']}: {summary(res)}", flush=True)
    order = {n: i for i, n in enumerate(BENCHES)}
    results.sort(key=lambda r: (order[r["bench"]], r["ranks"]))
    doc = write(out_dir, results, args.size, args.repeats)
    print((out_dir / "bench.md").read_text())
    bad = [r for r in doc["results"] if "error" in r or (r.get("check") and
                                                          not r["check"]["ok"])]
    return 1 if bad else 0


def summary(res: dict) -> str:
    if "error" in res:
        return f"FAILED: {res['error']} (log: {res['log']})"
    ratios = ", ".join(f"{q['name']} = {q['value']:.3g} (target {q['target']})"
                       for q in res.get("ratios", []))
    check = res.get("check") or {}
    return f"{ratios or 'done'}; same result: {check.get('ok')} ({res['wall_s']:.0f} s)"
