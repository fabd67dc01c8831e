"""``python -m benchmarks [--only NAME ...] [--size tiny|small] [--repeats N] [--smoke] --out DIR``

Runs every comparison of :mod:`benchmarks` in one command (from the repository root;
``make bench``): each part is launched here under ``mpirun`` at the world sizes it needs (the
user does not start MPI; the ranks run :mod:`benchmarks.worker`), its result is collected, and
``DIR/bench.json`` and ``DIR/bench.md`` are written. Exit status 1 when a part failed or the
two sides of a comparison did not compute the same thing; missed speed targets are reported,
not failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

from hpctrain.job.launch import command, launch_env, with_checkout

from . import BENCHES, SIZES

ACROSS_SIZES = ("scaling",)  # its efficiency compares world sizes
OWN_TEST = ("faults",)  # --smoke leaves it out: tests/e2e/test_fault_campaign.py runs it

PROG = "python -m benchmarks"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="benchmarks side by side: vs PyTorch, "
                                "the naive baseline and the limit (run from the repository root)")
    p.add_argument("--only", action="append", choices=sorted(BENCHES), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(BENCHES)}")
    p.add_argument("--size", choices=SIZES, default="small",
                   help="tiny: seconds (smoke test); small: the README's numbers")
    p.add_argument("--repeats", type=int, default=5,
                   help="repetitions of each measurement (interleaved A/B pairs: at least 5)")
    p.add_argument("--out", required=True, help="directory for bench.json and bench.md")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mpirun launch")
    p.add_argument("--smoke", action="store_true",
                   help="each part once, at its smallest world size (scaling, whose "
                        "comparison is across world sizes, at all of them), but those with "
                        f"a CI test of their own ({', '.join(OWN_TEST)}): the CI check")
    return p


def world_sizes(name: str, smoke: bool) -> tuple[int, ...]:
    """The world sizes a part runs at: all of BENCHES's, or with ``--smoke`` the smallest
    (every size for a part whose comparison spans them)."""
    sizes = BENCHES[name]
    return sizes if not smoke or name in ACROSS_SIZES else sizes[:1]


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def launch(names: list[str], ranks: int, args, parts: Path) -> list[dict]:
    """One ``mpirun -n ranks python -m mpi4py -m benchmarks.worker NAME ...`` running every
    benchmark of this world size in turn; their results, ``{"error": ...}`` (with the tail
    of the output) for each that left none."""
    cmd = command(ranks, sys.executable, "-m", "mpi4py", "-m", f"{__package__}.worker", *names,
                  "--size", args.size, "--repeats", str(args.repeats), "--out", str(parts))
    log = parts / f"n{ranks}.log"
    env = with_checkout({**os.environ, **launch_env()})
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
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
    return find_spec(f".{name}", __package__) is not None


def run(args) -> int:
    from .report import write

    if args.repeats < 1:
        print(f"{PROG}: --repeats must be >= 1", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or list(BENCHES)) if available(n)
             and not (args.smoke and not args.only and n in OWN_TEST)]
    for n in set(args.only or BENCHES) - set(names):
        print(f"[bench] {n}: not in this build, skipped", flush=True)
    results = []
    for ranks in sorted({r for n in names for r in world_sizes(n, args.smoke)}):
        group = [n for n in names if ranks in world_sizes(n, args.smoke)]
        print(f"[bench] {', '.join(group)} on {ranks} rank(s) ...", flush=True)
        for res in launch(group, ranks, args, parts):
            results.append(res)
            print(f"[bench]   {res['bench']}: {summary(res)}", flush=True)
    order = {n: i for i, n in enumerate(BENCHES)}
    results.sort(key=lambda r: (order[r["bench"]], r["ranks"]))
    if "scaling" in names:
        from .scaling import combine

        combine(results)
    doc = write(out_dir, results, args.size, args.repeats)
    print((out_dir / "bench.md").read_text())
    bad = [r for r in doc["results"] if "error" in r or (r.get("check") and
                                                          not r["check"]["ok"])]
    return 1 if bad else 0


def summary(res: dict) -> str:
    if "error" in res:
        return f"FAILED: {res['error']} (log: {res['log']})"
    ratios = ", ".join(f"{q['name']} = {q['value']:.3g}{' (noise)' if q.get('noise') else ''}"
                       f" (target {q['target']})" for q in res.get("ratios", []))
    check = res.get("check") or {}
    return f"{ratios or 'done'}; same result: {check.get('ok')} ({res['wall_s']:.0f} s)"
