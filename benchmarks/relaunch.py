"""Recovering from a failure: time to recover (failure detected -> first step done) and steps
lost, for a requeue from the HDF5 checkpoint (a new job: start + load; the queue wait a
real requeue adds is not in it), a relaunch inside the allocation from the HDF5 checkpoint
(``hpctrain launch --relaunch``: probe, start + load), and, where the build has the
node-local checkpoint tier, a relaunch from it; plus that tier's blocked time per save
against a step.

Rank 0 of a one-rank world drives everything (``python -m benchmarks --only relaunch
--size small``): ``RANKS`` training ranks on this machine, the tests' tiny model in float64,
``STEPS`` steps, an HDF5 checkpoint every ``EVERY`` steps; one training rank is killed
(SIGKILL, its whole process) once ``KILL_AT`` steps are logged. Each variant runs once (the
measurement takes a minute); at ``--size tiny`` nothing is measured (a note says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpctrain.job.launch import ROOT, command, nested_env

from .common import median, result, row

RANKS, STEPS, EVERY, KILL_AT = 2, 12, 4, 7
CONFIG = str(ROOT / "share" / "configs" / "tiny-llama.toml")
LOCAL = ("checkpoint.local_every=1", "checkpoint.local_dir={d}/local/{{node}}")


def _train(run_dir: Path, extra: tuple = ()) -> list[str]:
    sets = [f"topology.dp={RANKS}", f"train.steps={STEPS}", f"checkpoint.every={EVERY}", *extra]
    return [sys.executable, "-m", "mpi4py", "-m", "hpctrain", "train", CONFIG, "--run-dir",
            str(run_dir), *[w for s in sets for w in ("--set", s)]]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def _kill_a_rank(proc, run_dir: Path, timeout: float = 300) -> None:
    """SIGKILL one training rank once ``KILL_AT`` steps are in metrics.jsonl."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= KILL_AT):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before step {KILL_AT}")
        time.sleep(0.05)
    ranks = [p for p in _descendants(proc.pid)
             if b"hpctrain" in Path(f"/proc/{p}/cmdline").read_bytes()
             and b"mpirun" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(ranks[-1], signal.SIGKILL)


def _first_step(proc) -> tuple[float | None, int | None, str]:
    """(monotonic time of the first step line, the step resumed from, the output)."""
    first, resumed, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        if resumed is None and "] resumed from " in line:
            resumed = int(line.rsplit("at step ", 1)[1].split()[0])
        if first is None and line.startswith("[hpctrain] step "):
            first = time.monotonic()
    proc.wait()
    return first, resumed, "".join(lines)


def _last_step(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return max(json.loads(x)["step"] for x in lines) if lines else 0


def requeue(d: Path, extra: tuple = ()) -> dict:
    """The failed job ends; a new one starts and loads: detected -> first step done."""
    run_dir, env = d / "requeue", nested_env()
    proc = subprocess.Popen(command(RANKS, *_train(run_dir, extra)), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_a_rank(proc, run_dir)
    proc.wait()
    detected, lost_from = time.monotonic(), _last_step(run_dir)
    again = subprocess.Popen(command(RANKS, *_train(run_dir, extra)), env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, resumed, out = _first_step(again)
    if again.returncode or first is None:
        raise RuntimeError(f"the requeued run failed:\n{out[-3000:]}")
    return {"recover_s": first - detected, "steps_lost": lost_from - (resumed or 0)}


def relaunch(d: Path, name: str, extra: tuple = ()) -> dict:
    """``hpctrain launch --relaunch 1`` on this host: its own record of the relaunch."""
    run_dir = d / name
    argv = [sys.executable, "-m", "hpctrain", "launch", "--relaunch", "1", "--hosts",
            f"localhost:{RANKS}", "--", *_train(run_dir, extra)]
    proc = subprocess.Popen(argv, env=nested_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _kill_a_rank(proc, run_dir)
    err = proc.communicate()[1]
    records = [json.loads(x) for x in (run_dir / "relaunch.jsonl").read_text().splitlines()]
    done = [r for r in records if "recover_s" in r]
    if proc.returncode or not done or done[-1]["recover_s"] is None:
        raise RuntimeError(f"the relaunch failed:\n{err[-3000:]}")
    return {"recover_s": done[-1]["recover_s"], "steps_lost": done[-1]["steps_lost"]}


def local_cost(run_dir: Path) -> dict | None:
    """The local tier's blocked seconds per save against a step (metrics.jsonl)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    blocked = [r["local_blocked_s"] for r in rows if r.get("local_blocked_s")]
    steps = [r["step_time_s"] for r in rows]
    return {"blocked": blocked, "step": steps} if blocked else None


def has_local_tier() -> bool:
    from hpctrain.config import CheckpointConfig

    return hasattr(CheckpointConfig(), "local_every")


def run(world, size: str, repeats: int) -> dict:
    out = result("relaunch", world, size, repeats,
                 f"{RANKS} ranks, tiny model, {STEPS} steps, HDF5 every {EVERY}, one rank "
                 f"killed after step {KILL_AT}: failure detected -> first step done")
    if world.rank != 0:
        return out
    if size == "tiny":
        out["notes"].append("measured at --size small only (a minute of restarts)")
        return out
    with tempfile.TemporaryDirectory(prefix="hpct-relaunch-") as tmp:
        d = Path(tmp)
        variants = {"requeue from HDF5 (new job start + load; no queue wait)": requeue(d),
                    "relaunch from HDF5": relaunch(d, "relaunch")}
        if has_local_tier():
            local = tuple(x.format(d=d) for x in LOCAL)
            variants["relaunch from the local tier"] = relaunch(d, "local", local)
            cost = local_cost(d / "local")
            if cost:
                out["rows"].append(row("local tier: blocked per save", cost["blocked"]))
                out["rows"].append(row("step time", cost["step"]))
                out["notes"].append(f"local tier blocked per save / step: "
                                    f"{median(cost['blocked']) / median(cost['step']):.3f}")
    out["rows"][:0] = [row(f"{name}: time to recover", [v["recover_s"]])
                       for name, v in variants.items()]
    for name, v in variants.items():
        out["notes"].append(f"{name}: {v['recover_s']:.2f} s to recover, "
                            f"{v['steps_lost']} step(s) lost")
    return out
