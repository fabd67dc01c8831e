"""``python -m benchmarks [--only NAME ...] [--size tiny|small] [--repeats N] [--smoke] --out DIR``

Runs every comparison of :mod:`benchmarks` in one command (from the repository root;
``make bench``): each part is launched here under ``mpirun`` at the world sizes it needs (the
user does not start MPI; the ranks run :mod:`benchmarks.worker`), its result is collected, and
``DIR/bench.json`` and ``DIR/bench.md`` are written. Each part runs in its own launch within
its own time budget (:data:`benchmarks.BUDGETS`); one that fails or runs out is reported and
the others still run, and the files are rewritten after every part, so an interrupted run
keeps what it measured. Exit status 1 when a part failed or the two sides of a comparison
did not compute the same thing; missed speed targets are reported, not failed; 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from hpctrain.job.launch import command, launch_env, with_checkout

from . import BENCHES, BUDGETS, SIZES, module

ACROSS_SIZES = ("scaling",)  # its efficiency compares world sizes
# --smoke leaves these out: tests/e2e/test_fault_campaign.py, test_fuzz_foreign.py and
# test_interchange_memory.py run them
OWN_TEST = ("faults", "fuzz-foreign", "interchange")

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
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds each part may take (0: the part's own budget, scaled by "
                        "--size and --repeats)")
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


def budget(name: str, args) -> float:
    """Seconds part ``name`` may run: ``--timeout``, else its budget for this size/repeats."""
    if args.timeout:
        return args.timeout
    seconds = BUDGETS[name] * max(1.0, args.repeats / 5)
    return seconds / 3 if args.size == "tiny" else seconds


def launch(name: str, ranks: int, args, parts: Path) -> dict:
    """One ``mpirun -n ranks python -m mpi4py -m benchmarks.worker NAME ...`` within the
    part's budget (past it the launch's process group is stopped); its result, or
    ``{"error": ...}`` (with the tail of the output) when it left none."""
    cmd = command(ranks, sys.executable, "-m", "mpi4py", "-m", f"{__package__}.worker", name,
                  "--size", args.size, "--repeats", str(args.repeats), "--out", str(parts))
    log, limit = parts / f"{name}_n{ranks}.log", budget(name, args)
    env = with_checkout({**os.environ, **launch_env()})
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=limit)
            tail = log.read_text(errors="replace").strip().splitlines()
            why = f"exit {proc.returncode}: {tail[-1] if tail else ''}"
        except subprocess.TimeoutExpired:
            stop(proc)
            why = f"ran out of its budget ({limit:.0f} s; --timeout sets another)"
    f = parts / f"{name}_n{ranks}.json"
    return json.loads(f.read_text()) if f.is_file() else \
        {"bench": name, "ranks": ranks, "error": why, "log": str(log)}


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a launch and every rank it started (its own process group): SIGTERM, then SIGKILL
    to whatever of the group is left after ``grace`` seconds. Returns once the launcher is
    reaped and no process of the group runs (ranks outlive their launcher by a moment)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_runs(proc.pid):
                return
            time.sleep(0.1)


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies are not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


def available(name: str) -> bool:
    return find_spec(f".{module(name)}", __package__) is not None


def run(args) -> int:
    if args.repeats < 1:
        print(f"{PROG}: --repeats must be >= 1", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or list(BENCHES)) if available(n)
             and not (args.smoke and not args.only and n in OWN_TEST)]
    for n in set(args.only or BENCHES) - set(names):
        why = "its own CI test runs it" if n in OWN_TEST else "not in this build"
        print(f"[bench] {n}: skipped ({why})", flush=True)
    results: list[dict] = []
    for ranks in sorted({r for n in names for r in world_sizes(n, args.smoke)}):
        for name in [n for n in names if ranks in world_sizes(n, args.smoke)]:
            print(f"[bench] {name} on {ranks} rank(s) (budget {budget(name, args):.0f} s) ...",
                  flush=True)
            results.append(launch(name, ranks, args, parts))
            print(f"[bench]   {name}: {summary(results[-1])}", flush=True)
            written(out_dir, results, args)  # what is measured so far stays
    doc = written(out_dir, results, args, combined="scaling" in names)
    print((out_dir / "bench.md").read_text())
    bad = [r for r in doc["results"] if "error" in r or (r.get("check") and
                                                          not r["check"]["ok"])]
    return 1 if bad else 0


def written(out_dir: Path, results: list[dict], args, combined: bool = False) -> dict:
    """Write bench.json and bench.md of ``results`` (in BENCHES's order; at the end, with
    ``combined``, scaling's efficiencies across its world sizes); the document."""
    from .report import write

    order = {n: i for i, n in enumerate(BENCHES)}
    done = sorted(results, key=lambda r: (order[r["bench"]], r["ranks"]))
    if combined:
        from .scaling import combine

        combine(done)
    return write(out_dir, done, args.size, args.repeats)


def summary(res: dict) -> str:
    if "error" in res:
        return f"FAILED: {res['error']} (log: {res['log']})"
    ratios = ", ".join(f"{q['name']} = {q['value']:.3g}{' (noise)' if q.get('noise') else ''}"
                       f" (target {q['target']})" for q in res.get("ratios", []))
    check = res.get("check") or {}
    return f"{ratios or 'done'}; same result: {check.get('ok')} ({res['wall_s']:.0f} s)"
