"""The foreign-checkpoint fuzz campaign: crafted and damaged checkpoints of other trainers are
data, never code, and never a traceback.

``python -m benchmarks --only fuzz-foreign`` (10,000 cases; ``--size tiny``: 500, the CI run
of tests/e2e/test_fuzz_foreign.py), or alone ``python -m benchmarks.fuzz_foreign --cases N
[--seed S] [--workers W]`` (exit 1 when a case broke a rule). ``HPCTRAIN_FUZZ_SEED`` picks
the draw (default 64), ``HPCTRAIN_FUZZ_WORKERS`` the workers (default: up to 3);
``HPCTRAIN_FUZZ_LOG=FILE`` appends every case's mutation and outcome to FILE (JSON lines).

Each case is a real checkpoint (:mod:`benchmarks.fuzz_fixtures`: a torchtitan DCP, a
Megatron-LM save with ``common.pt``, a Hugging Face safetensors directory) with one file
mutated (:mod:`benchmarks.fuzz_cases`: opcode-level, byte-level, hand-written gadgets),
copied into a fresh scratch directory and converted by ``hpctrain import`` (the CLI's
``main``) in a worker (:mod:`benchmarks.fuzz_worker`: a long-lived process that forks a child
per case, killed past ``TIMEOUT_S``). Beside the scratch directory lies a sentinel tree (a
run's checkpoints, a victim file, decoy checkpoints a crafted path may name), compared by
names, sizes, mtimes and hashes after every case. The rules, each a kind of violation:

- nothing outside the scratch directory is created, changed or deleted (the sentinel tree,
  the worker's and the campaign's directories, and the worker's audit hook);
- no process is started, no module outside the admitted list (what the unmutated
  conversions import) is imported, no class or global a pickle can reach is changed;
- no file outside the checkpoint is read (but those the unmutated conversion reads);
- the result is the same model as the unmutated file's (every ``model/`` and ``optim/``
  dataset), or exit 2 with one ``hpctrain import:`` line on stderr, no traceback and no
  output left; no hang.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .fuzz_cases import Case, Context, Targets, draw
from .fuzz_fixtures import Fixture, build

RANKS = (1,)
COUNT = {"tiny": 500, "small": 10_000}
TIMEOUT_S = 10.0  # a conversion running longer is a hang
GRACE_S = 60.0  # a worker that answers nothing this long after a case's limit is stuck
EXAMPLES = 4  # shown per kind of violation
SAME, REFUSED = "same model (exit 0)", "refused (exit 2, one message)"


# -- the sentinel tree ----------------------------------------------------------------------
def make_sentinel(where: Path, fixtures: Path) -> None:
    """A run's checkpoints, a victim file, some data, and the decoy checkpoints."""
    (where / "run" / "checkpoints").mkdir(parents=True)
    (where / "run" / "checkpoints" / "step_00000010.h5").write_bytes(os.urandom(4096))
    (where / "run" / "checkpoints" / "latest").write_text("step_00000010.h5\n")
    (where / "victim.txt").write_text("a file an attack would delete or overwrite\n")
    shutil.copytree(fixtures / "decoys", where / "decoys")


def snapshot(root: Path) -> dict[str, tuple]:
    """{relative path: (kind, size, mtime, sha256)} of everything under ``root`` (a
    directory's mtime changes when an entry is made or removed in it)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = ""
            if name in filenames and os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            kind = "link" if os.path.islink(p) else "dir" if name in dirnames else "file"
            out[os.path.relpath(p, root)] = (kind, st.st_size if kind == "file" else 0,
                                             st.st_mtime_ns, digest)
    return out


def differences(before: dict, after: dict) -> list[str]:
    created = sorted(set(after) - set(before))
    deleted = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return [f"created {k}" for k in created] + [f"deleted {k}" for k in deleted] + \
        [f"changed {k}" for k in changed]


# -- a worker -------------------------------------------------------------------------------
class Worker:
    """One ``python -m benchmarks.fuzz_worker`` with its directory: ``sentinel/`` and
    ``case/`` (the scratch directory, made afresh for every case)."""

    def __init__(self, n: int, root: Path):
        self.n, self.root, self.fixtures = n, root, {}
        self.dir = root / f"w{n}"
        self.sentinel, self.scratch = self.dir / "sentinel", self.dir / "case"
        self.dir.mkdir()
        self.log = root / "logs" / f"w{n}.log"
        self.proc: subprocess.Popen | None = None
        self.buffer, self.case, self.deadline = b"", None, 0.0
        self.learned: list[dict] = []
        self.pristine: dict = {}

    def context(self) -> Context:
        return Context(self.scratch / "in", self.sentinel / "victim.txt",
                       self.sentinel / "decoys")

    def spawn(self) -> None:
        """Start the worker process (it loads torch and hpctrain meanwhile)."""
        from hpctrain.job.launch import with_checkout, without_job

        env = with_checkout({**without_job(dict(os.environ)), "OMP_NUM_THREADS": "1",
                             "HDF5_USE_FILE_LOCKING": "FALSE"})
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fuzz_worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, cwd=self.dir, env=env,
                                         start_new_session=True)
        self.buffer, self.learned = b"", []

    def learning(self, fixtures: dict[str, Fixture]) -> list[str]:
        """The unmutated conversions a worker learns from: every fixture twice (what the
        second run changes of what the first left is not a finding)."""
        self.fixtures = fixtures
        if not self.sentinel.exists():
            make_sentinel(self.sentinel, self.root / "fixtures")
            self.pristine = snapshot(self.sentinel)
        return [kind for _ in range(2) for kind in fixtures]

    def learned_from(self, reply: dict) -> None:
        if not reply.get("ok"):
            raise RuntimeError(f"an unmutated conversion failed in worker {self.n}: {reply}")
        self.learned.append(reply)

    def restart(self) -> None:
        self.stop()
        self.spawn()
        for kind in self.learning(self.fixtures):
            self.learned_from(self.call(self.command("learn", kind, None)))

    def command(self, op: str, kind: str, case: Case | None) -> dict:
        """Lay out the scratch directory (the fixture, ``case``'s files over it) and the
        command that converts it."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        source = self.scratch / "in"
        shutil.copytree(self.fixtures[kind].path, source)
        for rel, data in (case.files if case else {}).items():
            place(source / rel, data)
        out = self.scratch / "out"
        return {"op": op, "id": case.index if case else None, "kind": kind,
                "argv": ["import", str(source), *self.fixtures[kind].args, "--out", str(out)],
                "scratch": str(self.scratch), "source": str(source), "out": str(out),
                "files": [str(source / rel) for rel in (case.files if case else {})],
                "timeout": TIMEOUT_S}

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def call(self, cmd: dict | None) -> dict:
        """Send ``cmd`` (None: sent already) and wait for its answer."""
        if cmd is not None:
            self.send(cmd)
        while b"\n" not in self.buffer:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"worker {self.n} ended; see {self.log}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def read(self) -> dict | None:
        """What the worker answered so far: a whole result, or None."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return {"died": f"the worker ended (see {self.log})"}
        self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def outside(self) -> list[str]:
        """What changed outside the scratch directory: the sentinel tree, and entries of
        the worker's directory other than the sentinel and the scratch directory."""
        found = differences(self.pristine, snapshot(self.sentinel))
        extra = sorted(set(os.listdir(self.dir)) - {"sentinel", "case"})
        return [f"sentinel: {d}" for d in found] + [f"{self.dir.name}/{e} created" for e in extra]

    def restore(self) -> None:
        """The sentinel tree and the worker's directory as they were."""
        for name in set(os.listdir(self.dir)) - {"case"}:
            p = self.dir / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        make_sentinel(self.sentinel, self.root / "fixtures")
        self.pristine = snapshot(self.sentinel)


def place(path: Path, data) -> None:
    """Put a case's file: bytes, None (removed), or ("truncate", n)."""
    if data is None:
        path.unlink()
    elif isinstance(data, tuple):
        os.truncate(path, data[1])
    else:
        path.write_bytes(data)


# -- outcomes -------------------------------------------------------------------------------
def violations(res: dict, outside: list[str]) -> list[tuple[str, str]]:
    """Every rule case result ``res`` broke: (kind, detail)."""
    if "hang" in res:
        return [("hang", f"ran past {TIMEOUT_S:g} s (in its {res.get('after')})")]
    if "died" in res:
        return [("crash", res["died"])]
    if "error" in res:  # the checkpoint or the process after the case could not be checked
        return [("the checks after the case failed", res["error"][-300:])]
    found = [("wrote outside the scratch directory", d) for d in outside]
    names = {"write": "wrote outside the scratch directory", "process": "started a process",
             "import": "imported a module outside the admitted list",
             "read": "read a file outside the checkpoint",
             "hook": "the checks after the case failed"}
    found += [(names[kind], detail) for kind, detail in res["seen"]]
    found += [(names["import"], m) for m in res["modules"]
              if (names["import"], m) not in found]
    if res["state"]:
        found.append(("changed a class or global process-wide", ", ".join(res["state"][:4])))
    return found + result_violations(res)


def result_violations(res: dict) -> list[tuple[str, str]]:
    """What the conversion ended with: the same model, or one refusal and nothing left."""
    rc, err = res["rc"], res["stderr"]
    if rc == 0 and not res["exception"] and "Traceback" not in err:
        model = res["model"]
        return [] if model["same"] else [("imported other weights (exit 0)", model["what"])]
    lines = [x for x in err.splitlines() if x.strip()]
    found = [("failed but left output behind", lines[-1][:200] if lines else "")] \
        if res["out_exists"] else []
    if res["exception"] or "Traceback" in err:
        last = (res["exception"] or err).strip().splitlines()[-1]
        return [("traceback", last[:300]), *found]
    if rc != 2:
        return [("exit status other than 0 or 2", f"exit {rc}: {err.strip()[-200:]}"), *found]
    if len(lines) != 1 or not lines[0].startswith("hpctrain import: "):
        found.append(("refusal not one message", err.strip()[:300]))
    return found


class Tally:
    """Counts of each outcome and kind of violation, and examples of each violation."""

    def __init__(self):
        self.outcomes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.families: dict[str, Counter] = {}
        self.examples: dict[str, list[str]] = {}
        self.seconds: list[float] = []

    def add(self, case: Case, res: dict, found: list[tuple[str, str]]) -> None:
        outcome = "violation" if found else SAME if res.get("rc") == 0 else REFUSED
        self.outcomes[outcome] += 1
        self.families.setdefault(f"{case.kind} {case.family}", Counter())[outcome] += 1
        for kind in dict.fromkeys(k for k, _ in found):
            self.kinds[kind] += 1
            detail = next(d for k, d in found if k == kind)
            ex = self.examples.setdefault(kind, [])
            source = f"({case.kind} {case.family})"
            if len(ex) < EXAMPLES and not any(source in e for e in ex):  # from each source
                ex.append(f"case {case.index} {source} {case.what[:240]} => {detail[:300]}")
        if "seconds" in res:
            self.seconds.append(res["seconds"])

    def lines(self) -> list[str]:
        total = sum(self.outcomes.values())
        out = [f"{n:6d}  {k}" for k, n in ((SAME, self.outcomes[SAME]),
                                          (REFUSED, self.outcomes[REFUSED]))]
        out.append(f"{self.outcomes['violation']:6d}  cases with a violation (of {total}):")
        out += [f"{n:6d}    {k}" for k, n in self.kinds.most_common()]
        for kind, ex in self.examples.items():
            out += [f"e.g. [{kind}] {e}" for e in ex]
        return out


# -- the campaign ---------------------------------------------------------------------------
def campaign(n: int, seed: int, workers: int, root: Path, say=print) -> Tally:
    """Run cases 0..n-1 of ``seed`` on ``workers`` workers under ``root``."""
    (root / "logs").mkdir(parents=True)
    pool = [Worker(i, root) for i in range(workers)]
    for w in pool:
        w.spawn()
    try:
        fixtures = build(root / "fixtures")
        targets, tally, fixed = Targets(fixtures), Tally(), snapshot(root / "fixtures")
        start(pool, fixtures, say)
        run_cases(pool, n, seed, targets, tally, say)
    finally:
        for w in pool:
            w.stop()
    lost = differences(fixed, snapshot(root / "fixtures"))
    if lost:
        tally.kinds["wrote outside the scratch directory"] += 1
        tally.examples.setdefault("wrote outside the scratch directory", []).append(
            f"the fixtures changed during the campaign: {lost[:3]}")
    return tally


def start(pool: list[Worker], fixtures: dict[str, Fixture], say) -> None:
    """Every worker learns from the unmutated conversions, side by side."""
    plans = [w.learning(fixtures) for w in pool]
    for step in range(len(plans[0])):
        for w, plan in zip(pool, plans):
            w.send(w.command("learn", plan[step], None))
        for w in pool:
            w.learned_from(w.call(None))
    last = pool[0].learned[-1]
    say(f"[fuzz] {len(pool)} workers ready; admitted: {last['modules']} modules, the "
        f"processes {last['processes']}, reads outside Python and hpctrain {last['reads']}, "
        f"writes outside {last['writes']}", flush=True)


def run_cases(pool: list[Worker], n: int, seed: int, targets: Targets, tally: Tally,
              say) -> None:
    """Cases 0..n-1, each given to the next free worker; a worker that hangs past the
    case's limit and GRACE_S, or ends, is started again."""
    sel, todo, t0 = selectors.DefaultSelector(), iter(range(n)), time.monotonic()
    for w in pool:
        dispatch(w, todo, seed, targets, sel)
    while any(w.case is not None for w in pool):
        for w in expired(pool):
            finish(w, {"hang": True, "after": "worker"}, tally, sel)
            w.restart()
            dispatch(w, todo, seed, targets, sel)
        for key, _ in sel.select(timeout=1.0):
            w = key.data
            res = w.read()
            if res is None:
                continue
            finish(w, res, tally, sel)
            if "died" in res and w.proc.poll() is not None:
                w.restart()
            dispatch(w, todo, seed, targets, sel)
        progress(tally, n, t0, say)


def dispatch(w: Worker, todo, seed: int, targets: Targets, sel) -> None:
    """Give worker ``w`` the next case, if any."""
    index = next(todo, None)
    if index is None:
        return
    case = draw(index, seed, targets, w.context())
    w.case, w.deadline = case, time.monotonic() + TIMEOUT_S + GRACE_S
    w.send(w.command("case", case.kind, case))
    sel.register(w.proc.stdout, selectors.EVENT_READ, w)


def expired(pool: list[Worker]) -> list[Worker]:
    now = time.monotonic()
    return [w for w in pool if w.case is not None and now > w.deadline]


def finish(w: Worker, res: dict, tally: Tally, sel) -> None:
    """Judge worker ``w``'s case by its result and what changed outside its scratch."""
    sel.unregister(w.proc.stdout)
    outside = w.outside()
    outside += [f"{e} created" for e in sorted(set(os.listdir(w.root)) - {
        "fixtures", "logs", *(f"w{i}" for i in range(64))})]
    found = violations(res, outside)
    if w.case.family == "control" and not found and res.get("rc") != 0:
        found = [("refused a file that means the same", res["stderr"].strip()[:300])]
    tally.add(w.case, res, found)
    log = os.environ.get("HPCTRAIN_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"case": w.case.index, "kind": w.case.kind,
                                "family": w.case.family, "what": w.case.what,
                                "rc": res.get("rc"), "stderr": res.get("stderr", "")[-300:],
                                "violations": found}) + "\n")
    if outside:
        w.restore()
    w.case = None
    shutil.rmtree(w.scratch, ignore_errors=True)


def progress(tally: Tally, n: int, t0: float, say) -> None:
    done = sum(tally.outcomes.values())
    if done and (done % max(n // 20, 1) == 0) and getattr(progress, "last", None) != done:
        progress.last = done
        say(f"[fuzz] {done}/{n} cases in {time.monotonic() - t0:.0f} s: "
            f"{dict(tally.outcomes)}", flush=True)


def settings() -> tuple[int, int]:
    """(seed, workers) from HPCTRAIN_FUZZ_SEED and HPCTRAIN_FUZZ_WORKERS."""
    seed = int(os.environ.get("HPCTRAIN_FUZZ_SEED", "64"))
    workers = int(os.environ.get("HPCTRAIN_FUZZ_WORKERS", min(3, os.cpu_count() or 1)))
    return seed, max(1, workers)


def report(tally: Tally, n: int, seed: int, workers: int, seconds: float) -> list[str]:
    head = (f"{n} cases (seed {seed}, {workers} workers) in {seconds:.0f} s; each case "
            f"under {TIMEOUT_S:g} s")
    families = [f"{k}: {dict(c)}" for k, c in sorted(tally.families.items())]
    return [head, *tally.lines(), "by fixture and mutation: " + "; ".join(families)]


def run(world, size: str, repeats: int) -> dict:
    from .common import result, row

    n = COUNT[size]
    seed, workers = settings()
    out = result("fuzz-foreign", world, size, repeats,
                 f"{n} mutated torchtitan DCP, Megatron-LM and Hugging Face checkpoints "
                 f"through hpctrain import (seed {seed})")
    if world.rank != 0:
        return out
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpct-fuzz-") as tmp:
        tally = campaign(n, seed, workers, Path(tmp))
    bad = sum(tally.kinds.values())
    out["rows"] = [row("conversion of one case", tally.seconds or [0.0])]
    out["notes"] = report(tally, n, seed, workers, time.monotonic() - t0)
    out["table"] = [{"outcome": k, "cases": v} for k, v in tally.outcomes.items()] + \
        [{"violation": k, "cases": v, "examples": tally.examples.get(k, [])}
         for k, v in tally.kinds.items()]
    out["check"] = {"what": "cases that broke a rule (of all cases)",
                    "values": [tally.outcomes["violation"], n], "rel_err": 0.0, "tol": 0.0,
                    "ok": bad == 0 and sum(tally.outcomes.values()) == n}
    return out


def main(argv=None) -> int:
    seed, workers = settings()
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_foreign",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=COUNT["small"])
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--keep", help="work in this directory (kept) instead of a temporary one")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpct-fuzz-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        tally = campaign(args.cases, args.seed, args.workers, root)
    print("\n".join(report(tally, args.cases, args.seed, args.workers,
                           time.monotonic() - t0)))
    return 1 if tally.kinds or sum(tally.outcomes.values()) != args.cases else 0


if __name__ == "__main__":
    sys.exit(main())
