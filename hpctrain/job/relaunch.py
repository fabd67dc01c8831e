"""Relaunch a failed training step inside the allocation (``hpctrain launch --relaunch N``).

Standard library only, no MPI: this process is the job script's helper, not a rank. It

1. starts the step (``LAUNCHER -n RANKS`` on the first hosts of ``--hosts``, the last
   ``--spare`` of them held back; under SLURM the allocation's nodes by default) and copies
   its output through, noting the steps it reports;
2. when the step fails (any exit status but 0, 75 (checkpointed, requeue me) and 2 (bad
   input: the same again would fail the same way)), probes every host not yet dropped with
   a one-rank ``true`` (in parallel, ``--probe-timeout`` seconds); a host that fails its
   probe is dropped for the rest of the job;
3. takes the first alive hosts, as many as the step used (spares replace dropped hosts);
   with fewer ranks than the configured layout it asks ``hpctrain plan --emit-overrides``
   for the best layout of the ranks left (same model, sequence and global batch);
4. starts the step again with ``checkpoint.resume=auto`` and that layout, up to
   ``--relaunch`` times; then (or when no host or no layout is left) exits 75, which the
   ``jobs/`` templates turn into a requeue. A failure that repeats (the same exception at
   the same step as the one before, in this job or the one before it: ``relaunch.jsonl``)
   is not a node's: the loop stops with exit 3 and says so, and the job is not requeued.

Each failure and relaunch is logged (``[relaunch]`` lines on stderr) and recorded in
``RUN_DIR/relaunch.jsonl``: the exit status, the hosts named in the launcher's message, the
hosts dropped and used, the layout, the step resumed from, the steps lost, and the seconds
from the failure detected to the first step done.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

EXIT_REQUEUE = 75  # hpctrain.job.slurm.EXIT_REQUEUE (not imported: that module is not stdlib-only)
EXIT_BAD_INPUT = 2
EXIT_REPEATED = 3  # the same failure at the same step again: not a node's, a requeue won't help
# What a failure that is not a lost node says: an uncaught exception on a rank, a failed save.
RAISED = re.compile(r"hpctrain: rank \d+ of \d+: unhandled (\S+?);|failed on rank \d+ "
                    r"\(([^:)]+)")
# A launcher's words for a rank or node that died: the step is over, whatever hangs after it.
DIED = re.compile(r"lost communication with a remote daemon|noticed that process rank|"
                  r"unexpectedly disconnected|^srun: error: \S+: tasks? |BAD TERMINATION")
STEP = re.compile(r"\[hpctrain\] step (\d+)/\d+ \|")
RESUMED = re.compile(r"\[hpctrain\] resumed from \S+ at step (\d+)")
# How launchers name the node of a rank that died: Open MPI, srun, Hydra.
NAMED = (re.compile(r"\bon node ([\w.-]+)"),
         re.compile(r"^srun: error: (\S+?): tasks? [\d,-]+: "),
         re.compile(r"host (\S+?) \(pid \d+\)|on host (\S+?)[:\s]"))


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hosts(text: str) -> list[Host]:
    """``"a:2,b:2"`` (or ``a,b`` for one slot each) -> hosts, in order."""
    out = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise ValueError(f"--hosts {text!r}: expected NAME:SLOTS,... (e.g. n0:2,n1:2)")
        out.append(Host(name, int(slots or 1)))
    return out


def tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``"2(x3),1"``) -> [2, 2, 2, 1]."""
    out = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={value!r}: not understood")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_hosts(env=os.environ) -> list[Host]:
    """The nodes of this SLURM allocation with their task counts (``scontrol``)."""
    names = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True, timeout=30).stdout.split()
    counts = tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "1"))
    counts += [counts[-1]] * (len(names) - len(counts))
    return [Host(n, c) for n, c in zip(names, counts)]


def named_hosts(text: str, hosts: list[Host]) -> list[str]:
    """Hosts of the allocation that the launcher's output names as where a rank died."""
    known = {h.name for h in hosts}
    seen = []
    for line in text.splitlines():
        for pattern in NAMED:
            for m in pattern.finditer(line):
                name = next((g for g in m.groups() if g), "")
                if name in known and name not in seen:
                    seen.append(name)
    return seen


def step_argv(launcher, hosts: list[Host], command: list[str]) -> list[str]:
    """The launcher's command line that runs ``command`` on exactly ``hosts``."""
    n = sum(h.slots for h in hosts)
    spec = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    if launcher.family == "openmpi":
        where = ["--host", spec]
    elif launcher.family == "hydra":
        where = ["-hosts", spec]
    else:  # srun: the same number of tasks on each node
        where = [f"--nodes={len(hosts)}", f"--nodelist={','.join(h.name for h in hosts)}",
                 f"--ntasks-per-node={hosts[0].slots}"]
    return [*launcher.argv(n, oversubscribe=launcher.family != "srun"), *where, *command]


def probe(launcher, hosts: list[Host], timeout: float) -> list[Host]:
    """The hosts on which a one-rank ``true`` succeeds within ``timeout`` s (in parallel)."""
    def ok(h: Host) -> bool:
        try:
            return subprocess.run(step_argv(launcher, [Host(h.name, 1)], ["true"]),
                                  capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False
    if not hosts:
        return []
    with ThreadPoolExecutor(len(hosts)) as pool:
        alive = list(pool.map(ok, hosts))
    return [h for h, a in zip(hosts, alive) if a]


def train_parts(command: list[str]) -> tuple[str, str, list[str], str]:
    """(python, config, --set values, run dir) of a ``... -m hpctrain train CONFIG ...``."""
    try:
        i = next(i for i in range(1, len(command)) if command[i] == "train"
                 and command[i - 1] == "hpctrain")
        config = command[i + 1]
    except (StopIteration, IndexError):
        raise ValueError("--relaunch: the command must be `PYTHON ... -m hpctrain train CONFIG "
                         "...` (it is re-planned for the ranks left)") from None
    sets = [command[j + 1] for j in range(i + 2, len(command) - 1) if command[j] == "--set"]
    run_dir = next((command[j + 1] for j in range(i + 2, len(command) - 1)
                    if command[j] == "--run-dir"), "")
    return command[0], config, sets, run_dir


def replan(command: list[str], hosts: list[Host], cluster: str = "") -> list[str]:
    """``--set`` words of the best layout for ``hosts`` (``hpctrain plan --emit-overrides``);
    ValueError with plan's message when none fits."""
    python, config, sets, _ = train_parts(command)
    world = sum(h.slots for h in hosts)
    argv = [python, "-m", "hpctrain", "plan", config, "--world-size", str(world),
            "--emit-overrides", *(["--cluster", cluster] if cluster else [])]
    if len({h.slots for h in hosts}) == 1:
        argv += ["--nodes", str(len(hosts))]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip() or f"hpctrain plan exited {proc.returncode}")
    return [w for line in proc.stdout.splitlines() for w in line.split(None, 1)]


def layout_of(words: list[str]) -> str:
    """``dp=2 tp=1 pp=2 ...`` from --set words (the topology and schedule keys)."""
    keep = ("topology.dp", "topology.tp", "topology.pp", "topology.cp", "schedule.kind")
    kv = [w.split("=", 1) for w in words[1::2]]
    return " ".join(f"{k.split('.')[1]}={v.strip(chr(34))}" for k, v in kv if k in keep)


@dataclass
class Attempt:
    """What one start of the step showed: exit status, steps, the output's tail."""

    rc: int = 0
    resumed: int | None = None  # the step resumed from (None: a fresh start)
    last_step: int = 0  # the last step reported done
    first_step_at: float | None = None  # monotonic time of the first step done
    died_at: float | None = None  # monotonic time the launcher first reported a dead rank
    tail: list[str] = field(default_factory=list)


def _copy(stream, out, attempt: Attempt, on_step) -> None:
    """Copy a child's stream to ``out``, noting steps and keeping the tail."""
    for line in iter(stream.readline, ""):
        out.write(line)
        out.flush()
        attempt.tail = (attempt.tail + [line])[-200:]
        if attempt.died_at is None and DIED.search(line):
            attempt.died_at = time.monotonic()
        if m := RESUMED.search(line):
            attempt.resumed = int(m.group(1))
        elif m := STEP.search(line):
            attempt.last_step = int(m.group(1))
            if attempt.first_step_at is None:
                attempt.first_step_at = time.monotonic()
                on_step(attempt)


def _end(proc, attempt: Attempt, grace: float) -> None:
    """Wait for the launcher; ``grace`` s after it reported a dead rank, end its process
    group (a launcher may hang while it tears down a job with a lost node)."""
    while proc.poll() is None:
        time.sleep(0.2)
        if attempt.died_at is not None and time.monotonic() - attempt.died_at > grace:
            log(f"the launcher still runs {grace:g} s after it reported a dead rank: ended")
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 30.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            break


def run_step(argv: list[str], on_step=lambda a: None, grace: float = 30.0) -> Attempt:
    """Run one step to its end, forwarding SIGUSR1/SIGTERM to the launcher (which hands them
    to every rank: preemption checkpoints and exits 75 as without this helper)."""
    attempt = Attempt()
    from .launch import LAUNCHED_AT

    env = {**os.environ, LAUNCHED_AT: repr(time.time())}  # this attempt's start-up from here
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True, env=env)
    forward = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
               for s in (signal.SIGUSR1, signal.SIGTERM)}
    readers = [threading.Thread(target=_copy, args=(stream, out, attempt, on_step))
               for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    try:
        for r in readers:
            r.start()
        _end(proc, attempt, grace)
        proc.wait()
        for r in readers:
            r.join()
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
    attempt.rc = proc.returncode
    return attempt


def log(msg: str) -> None:
    print(f"[relaunch] {msg}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    """The relaunch loop's state: the hosts, those in use, the layout chosen."""

    launcher: object
    hosts: list[Host]
    used: list[Host]
    command: list[str]
    relaunches: int
    probe_timeout: float = 30.0
    cluster: str = ""
    grace: float = 30.0  # seconds a launcher may take to end after a rank died
    world: int = 0  # the configured layout's ranks (those of the first start)
    dropped: list[str] = field(default_factory=list)
    layout: list[str] = field(default_factory=list)  # --set words of a re-planned layout

    def argv(self, again: bool) -> list[str]:
        extra = [*self.layout, *(["--set", "checkpoint.resume=auto"] if again else [])]
        return step_argv(self.launcher, self.used, [*self.command, *extra])

    def last_signature(self) -> list | None:
        """The signature of the last failure ``relaunch.jsonl`` records (an earlier job of
        this run, before a requeue), or None."""
        run_dir = train_parts(self.command)[3]
        try:
            lines = (Path(run_dir) / "relaunch.jsonl").read_text().splitlines() if run_dir \
                else []
        except OSError:
            return None
        entries = [json.loads(x) for x in lines if x.strip()]
        return next((e.get("signature") for e in reversed(entries) if "failure" in e), None)

    def record(self, entry: dict) -> None:
        run_dir = train_parts(self.command)[3]
        if run_dir and Path(run_dir).is_dir():
            with open(Path(run_dir) / "relaunch.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    def survivors(self, failed: Attempt) -> str | None:
        """Probe, drop dead hosts, choose hosts and layout for the next start; None, or why
        no relaunch is possible."""
        left = [h for h in self.hosts if h.name not in self.dropped]
        alive = probe(self.launcher, left, self.probe_timeout)
        self.dropped += [h.name for h in left if h not in alive]
        want = len(self.used)
        self.used = alive[:want]
        if not self.used:
            return "no host of the allocation answers"
        if sum(h.slots for h in self.used) == self.world:
            self.layout = []  # as many ranks as configured: the configured layout
            return None
        try:
            self.layout = replan(self.command, self.used, self.cluster)
        except ValueError as e:
            return f"no layout for the {sum(h.slots for h in self.used)} ranks left: {e}"
        return None


def signature(a: Attempt) -> list | None:
    """[the last step done, what was raised] of a failure that is not a lost rank or node
    (None: a rank died, or nothing was said)."""
    text = "".join(a.tail)
    if a.died_at is not None:
        return None
    m = RAISED.search(text)
    return [a.last_step, m.group(1) or m.group(2)] if m else None


def repeated(plan: Plan, a: Attempt, before: list | None) -> bool:
    """Whether this failure is the one before it again (logged, exit EXIT_REPEATED)."""
    sig = signature(a)
    if sig is None or sig != before:
        return False
    log(f"the same failure again after step {sig[0]} ({sig[1]}): not a lost node, a relaunch "
        f"or a requeue would fail the same way; stopping with exit {EXIT_REPEATED} (see the "
        "rank's message above; RUN_DIR/relaunch.jsonl)")
    plan.record({"repeated": sig, "rc": a.rc})
    return True


def loop(plan: Plan) -> int:
    """Start the step; relaunch it after a failure as the module docstring says. The exit
    status: the step's (0, 75, 2), 75 when the relaunches are spent, 3 when a failure
    repeats."""
    plan.world = plan.world or sum(h.slots for h in plan.used)
    failed_at, lost_from, before = None, 0, plan.last_signature()
    for attempt_no in range(plan.relaunches + 1):
        def first_step(a: Attempt, t0=failed_at, n=attempt_no) -> None:
            if t0 is not None:
                log(f"relaunch {n}: first step done {a.first_step_at - t0:.2f} s after the "
                    f"failure was detected (resumed at step {a.resumed})")
        a = run_step(plan.argv(attempt_no > 0), first_step, plan.grace)
        if failed_at is not None:
            plan.record({"relaunch": attempt_no, "resumed_step": a.resumed,
                         "steps_lost": max(0, lost_from - (a.resumed or 0)),
                         "recover_s": (a.first_step_at - failed_at) if a.first_step_at else None,
                         "rc": a.rc})
        if a.rc in (0, EXIT_REQUEUE, EXIT_BAD_INPUT):
            return a.rc
        if repeated(plan, a, before):
            return EXIT_REPEATED
        failed_at, lost_from, before = time.monotonic(), a.last_step, signature(a)
        named = named_hosts("".join(a.tail), plan.hosts)
        log(f"step failed: exit {a.rc} after step {a.last_step} on "
            f"{','.join(h.name for h in plan.used)}; the launcher names "
            f"{','.join(named) or 'no host'}")
        if attempt_no == plan.relaunches:
            log(f"{plan.relaunches} relaunch(es) spent: exit {EXIT_REQUEUE} (requeue)")
            return EXIT_REQUEUE
        why = plan.survivors(a)
        entry = {"failure": attempt_no + 1, "rc": a.rc, "last_step": a.last_step,
                 "signature": before, "named": named, "dropped": plan.dropped,
                 "hosts": [h.name for h in plan.used], "layout": plan.layout,
                 "detected_to_plan_s": time.monotonic() - failed_at}
        plan.record({**entry, "refused": why} if why else entry)
        if why:
            log(f"{why}: exit {EXIT_REQUEUE} (requeue)")
            return EXIT_REQUEUE
        ranks = sum(h.slots for h in plan.used)
        layout = layout_of(plan.layout) if plan.layout else "the configured layout"
        log(f"relaunch {attempt_no + 1}/{plan.relaunches} on {','.join(h.name for h in plan.used)}"
            f" ({ranks} ranks; dropped: {','.join(plan.dropped) or 'none'}), {layout}, "
            f"from the freshest checkpoint")
    return EXIT_REQUEUE  # not reached


def add_arguments(p) -> None:
    """``hpctrain launch``'s options of the relaunch loop."""
    g = p.add_argument_group("relaunch inside the allocation (hpctrain/job/relaunch.py)")
    g.add_argument("--relaunch", type=int, default=None, metavar="N",
                   help="run `... -m hpctrain train ...` on --hosts; after a failure probe "
                        "the hosts, re-plan for the ranks left, resume, up to N times; then "
                        "exit 75 (default: no relaunch)")
    g.add_argument("--hosts", default="", metavar="NAME:SLOTS,...",
                   help="--relaunch: the hosts (default: the SLURM job's nodes)")
    g.add_argument("--spare", type=int, default=0,
                   help="--relaunch: the last SPARE hosts stand by for dropped ones (default 0)")
    g.add_argument("--program", default="", metavar="CMD",
                   help="--relaunch: the launcher command, e.g. 'scripts/cluster.sh mpirun X' "
                        "or 'srun --mpi=pmix' (default: this machine's launcher)")
    g.add_argument("--probe-timeout", type=float, default=30.0,
                   help="--relaunch: seconds a host may take to run `true` (default 30)")
    g.add_argument("--grace", type=float, default=30.0,
                   help="--relaunch: seconds the launcher may take to end once it reported a "
                        "dead rank, then its process group is ended (default 30)")
    g.add_argument("--cluster", default="",
                   help="--relaunch: the cluster description the re-plan ranks layouts on "
                        "(default: hpctrain plan --emit-overrides's)")


def run(a, command: list[str]) -> int:
    """``hpctrain launch --relaunch N [--hosts ...] -- COMMAND``."""
    from .launch import Launcher, detect

    try:
        train_parts(command)
        hosts = parse_hosts(a.hosts) if a.hosts else (
            slurm_hosts() if os.environ.get("SLURM_JOB_NODELIST") else [])
        if not hosts:
            raise ValueError("--relaunch needs --hosts NAME:SLOTS,... outside a SLURM job")
        if not 0 <= a.spare < len(hosts):
            raise ValueError(f"--spare {a.spare}: keep at least one of {len(hosts)} host(s)")
        program = tuple(a.program.split()) if a.program else None
        if program and os.path.basename(program[0]) != "srun":
            launcher = Launcher(detect().family, program)  # e.g. scripts/cluster.sh mpirun X
        else:
            launcher = detect(program)
    except (ValueError, RuntimeError, subprocess.SubprocessError, OSError) as e:
        print(f"hpctrain launch: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from .launch import RUN_DEFAULTS

    for k, v in launcher.env().items():  # as a plain launch: the caller's run defaults win
        if k not in RUN_DEFAULTS or k not in os.environ:
            os.environ[k] = v
    used = hosts[:len(hosts) - a.spare]
    return loop(Plan(launcher, hosts, used, command, a.relaunch, a.probe_timeout, a.cluster,
                     a.grace))
