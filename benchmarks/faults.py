"""The fault campaign: a run that survives, by itself, a seeded series of faults on a
simulated cluster, and ends bit for bit where an uninterrupted run ends.

``python -m benchmarks --only faults`` (100 faults; ``--size tiny``: 8, the CI run of
tests/e2e/test_fault_campaign.py; ``HPCTRAIN_FAULT_SEED`` picks the draw, default 1). The
cluster is ``scripts/cluster.sh``'s: 3 nodes x 2 ranks, the run on 2 of them (dp=2 x pp=2,
the tests' tiny model in float64) and the third a spare (``hpctrain launch --relaunch
--spare 1``). HDF5 checkpoints every ``EVERY`` steps, the node-local tier with partner
copies every step. A fault every ``GAP`` steps (twice ``EVERY``), its kind, rank and
moment drawn from the seed:

==================  =======================================================================
``kill-step``       SIGKILL of a rank at a random moment of a step (from outside)
``kill-hdf5``       a rank dies halfway through writing the HDF5 checkpoint (``ckpt_kill``)
``kill-local``      a rank dies halfway through its node-local shard (``local_kill``)
``kill-partner``    a rank dies in the exchange with its partner node (``partner_kill``)
``sigterm``         every rank gets SIGTERM (a preemption): the job saves and exits 75; the
                    campaign starts the next job, as SLURM's requeue does, on a whole cluster
``sigstop``         SIGSTOP of a rank: the watchdog of the others ends the job
``full-local``      a rank's node-local write fails as on a full disk (``local_fail``)
``damaged-newest``  bytes inside a dataset of the newest HDF5 checkpoint flipped, then a
                    rank killed: the restart must not trust that file
``lost-node``       every process of a node killed and the node gone (its local storage
                    too): the relaunch takes the spare (at most one per job)
==================  =======================================================================

The in-process kinds go in ``HPCTRAIN_FAULTS`` with ``HPCTRAIN_FAULTS_ONCE`` (each acts
once, however often the step is redone). Per fault: the steps lost (the last step done
before it minus the step resumed from; ``relaunch.jsonl``) and the recovery time (failure
detected -> first step done; for a preemption, the next job's start -> its first step).
A fault "needed a human" when the run did not go on by itself. At the end the final
checkpoint's every dataset (parameters, optimizer state, data position) is compared byte
for byte with an uninterrupted run's (the same layout on this machine).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.job.launch import ROOT, nested_env, world_rank_of

from .common import median, result, row

RANKS = (1,)
SCRIPT = str(ROOT / "scripts" / "cluster.sh")
CONFIG = str(ROOT / "share" / "configs" / "tiny-llama.toml")
COUNT = {"tiny": 9, "small": 100}
EVERY, LOCAL_EVERY, WATCHDOG_S = 4, 1, 8.0
GAP = 2 * EVERY  # steps between faults: slack for a driver that lags a loaded machine
# Every rank sleeps this long in each step (fault kind slow): the tiny model trains a step in
# 30 ms, faster than the driver's polling and process lookup, which once landed an outside
# fault 23 steps late, onto the in-process fault armed after it
PACE_S = 0.25
NODES, SLOTS, WORLD = 3, 2, 4
IN_PROCESS = {"kill-hdf5": "ckpt_kill", "kill-local": "local_kill",
              "kill-partner": "partner_kill", "full-local": "local_fail"}
KINDS = ("kill-step", "kill-hdf5", "kill-local", "kill-partner", "sigterm", "sigstop",
         "full-local", "damaged-newest", "lost-node")
FAILS = set(KINDS) - {"sigterm", "full-local"}  # a relaunch follows these


@dataclass
class Fault:
    kind: str
    step: int  # it acts in this step (in-process kinds) or once the step before is done
    rank: int  # the world rank it hits (lost-node: that rank's node)
    delay: float  # kill-step, sigstop: seconds into the step
    job: int = 0
    lost: int | None = None  # steps lost
    recover_s: float | None = None  # failure detected -> first step done (relaunch.jsonl)
    wall_s: float | None = None  # the fault done -> the first step after it (this driver)
    human: str = ""  # what went wrong, when the run did not go on by itself


LOCAL_KINDS = ("kill-local", "kill-partner", "full-local")  # act in the local tier's writes


def draw(seed: int, n: int) -> list[Fault]:
    """``n`` faults, one every GAP steps (on an HDF5 save step), the kinds in seeded rounds
    that each hold every kind once (``n`` >= 9 meets them all); at most one lost node per
    job (the spare), and no local-tier fault while a full local directory has the tier off
    (until a relaunch)."""
    rng, out, pool, job, spare, tier = random.Random(seed), [], [], 0, True, True

    def allowed() -> list[str]:
        return [k for k in pool if (spare or k != "lost-node") and (tier or k not in LOCAL_KINDS)]

    for i in range(n):
        while not allowed():
            pool += rng.sample(KINDS, len(KINDS))
        kind = allowed()[0]
        pool.remove(kind)
        out.append(Fault(kind, GAP * (i + 1), rng.randrange(WORLD), rng.random(), job))
        spare = spare and kind != "lost-node"
        tier = kind != "full-local" and (tier or kind in FAILS or kind == "sigterm")
        if kind == "sigterm":
            job, spare = job + 1, True
    return out


def _parent_is_a_rank(pid: str) -> bool:
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        return b"hpctrain\0train" in Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


@dataclass
class Cluster:
    name: str
    env: dict = field(default_factory=nested_env)

    def sh(self, *args: str) -> None:
        subprocess.run([SCRIPT, *args], check=True, env=self.env, capture_output=True)

    def node(self, i: int) -> str:
        return f"hpct-{self.name}-n{i}"

    def pids(self, i: int) -> list[str]:
        """Every process in node i (none once the node is lost)."""
        return subprocess.run(["ip", "netns", "pids", self.node(i)], capture_output=True,
                              text=True).stdout.split()

    def quiet(self, timeout: float = 60.0) -> None:
        """Wait until no process of the last job is left on any node (an ending Open MPI
        daemon cleans its session directory, which the nodes of one machine share with the
        next job's), then kill what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = [p for i in range(NODES) for p in self.pids(i)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ranks(self) -> dict[int, int]:
        """world rank -> pid of every training rank on the cluster now."""
        out = {}
        for i in range(NODES):
            for pid in self.pids(i):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"hpctrain\0train" not in cmd or _parent_is_a_rank(pid):
                    continue  # a rank's own child (a helper it forked) shares its environment
                pairs = dict(v.decode(errors="replace").partition("=")[::2] for v in env if v)
                rank = world_rank_of(pairs)
                if rank is not None:
                    out[rank] = int(pid)
        return out

    def node_of(self, pid: int) -> int:
        for i in range(NODES):
            if str(pid) in self.pids(i):
                return i
        raise RuntimeError(f"pid {pid} is on no node")


class Job:
    """One ``hpctrain launch --relaunch`` on the cluster (a SLURM job's step loop), its
    output read as it comes."""

    def __init__(self, cl: Cluster, run_dir: Path, argv: list[str], env: dict):
        self.cl, self.run_dir, self.lines, self.t0 = cl, run_dir, [], time.monotonic()
        self.first_step_at: float | None = None
        self.recovered_at: dict[int, float] = {}  # relaunch number -> its first step
        self.failures = 0  # steps the launcher saw fail
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        log = os.environ.get("HPCTRAIN_FAULT_LOG")  # a copy of every job's output
        out = open(log, "a") if log else None  # noqa: SIM115 (closed below)
        for line in self.proc.stdout:
            self.lines.append(line)
            if out:
                out.write(line)
                out.flush()
            if self.first_step_at is None and line.startswith("[hpctrain] step "):
                self.first_step_at = time.monotonic()
            self.failures += line.startswith("[relaunch] step failed")
            if line.startswith("[relaunch] relaunch ") and ": first step done" in line:
                self.recovered_at[int(line.split()[2].rstrip(":"))] = time.monotonic()
        if out:
            out.close()

    def recovered(self, n: int) -> bool:
        """Whether the n-th relaunch of this job has done its first step."""
        return n in self.recovered_at

    def step(self) -> int:
        """The last step in metrics.jsonl (0: none yet)."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            return json.loads(lines[-1])["step"] if lines else 0
        except (OSError, ValueError, KeyError, IndexError):
            return 0

    def wait_for(self, what, timeout: float, why: str) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{why}: the job ended (exit {self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{why}: not within {timeout:.0f} s")
            time.sleep(0.02)

    def end(self, timeout: float = 600) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def tail(self) -> str:
        return "".join(self.lines[-60:])


def train_argv(run_dir: Path, local: Path, steps: int) -> list[str]:
    sets = ["topology.dp=2", "topology.pp=2", f"train.steps={steps}",
            "train.global_batch_size=8", f"checkpoint.every={EVERY}", "checkpoint.keep=2",
            f"checkpoint.local_every={LOCAL_EVERY}", f"checkpoint.local_dir={local}/{{node}}",
            f"telemetry.watchdog_s={WATCHDOG_S}", "telemetry.watchdog_factor=0"]
    return [sys.executable, "-m", "mpi4py", "-m", "hpctrain", "train", CONFIG, "--run-dir",
            str(run_dir), *[w for s in sets for w in ("--set", s)]]


def job_argv(cl: Cluster, relaunches: int, spare: int, train: list[str]) -> list[str]:
    hosts = ",".join(f"{cl.node(i)}:{SLOTS}" for i in range(NODES - 1 + spare))
    return [sys.executable, "-m", "hpctrain", "launch", "--relaunch", str(relaunches),
            "--spare", str(spare), "--hosts", hosts, "--probe-timeout", "20", "--grace", "10",
            "--program", f"{SCRIPT} mpirun {cl.name}", "--", *train]


def damage(run_dir: Path) -> str:
    """Flip 8 bytes in the middle of the largest contiguous dataset of the newest HDF5
    checkpoint (HDF5 pads between datasets: the bytes must be a dataset's own)."""
    import h5py

    ckpt = run_dir / "checkpoints"
    path = ckpt / (ckpt / "latest").read_text().strip()
    found = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: found.append((o.id.get_storage_size(), o.id.get_offset(), n))
                     if isinstance(o, h5py.Dataset) and o.id.get_offset() is not None
                     else None)
    size, offset, name = max(found)
    with open(path, "r+b") as fh:
        fh.seek(offset + size // 2)
        data = fh.read(8)
        fh.seek(offset + size // 2)
        fh.write(bytes(b ^ 0xFF for b in data))
    return f"{path.name}:{name}"


def pid_of(cl: Cluster, job: Job, rank: int) -> int:
    """The pid of world rank ``rank`` once every rank of the job is up."""
    ranks: dict = {}

    def up() -> bool:
        ranks.update(cl.ranks())
        return len(ranks) >= WORLD

    job.wait_for(up, 120, "the job's ranks")
    return ranks[rank]


def act(f: Fault, job: Job, cl: Cluster, local: Path) -> None:
    """Do fault ``f`` from outside (the in-process kinds were armed at the job's start)."""
    job.wait_for(lambda: job.step() >= f.step - 1, 240, f"step {f.step - 1} before {f.kind}")
    if f.kind in IN_PROCESS:
        return
    pid = pid_of(cl, job, f.rank)
    if f.kind == "sigterm":
        for p in cl.ranks().values():
            os.kill(p, signal.SIGTERM)
        return
    try:
        rows = (job.run_dir / "metrics.jsonl").read_text().splitlines()
        step_s = json.loads(rows[-1]).get("step_time_s", 0.1)
    except (OSError, ValueError, IndexError):
        step_s = 0.1
    time.sleep(f.delay * step_s)
    now = job.step()
    if now >= f.step + GAP // 2:  # it would merge with the next fault: say so
        raise RuntimeError(f"the campaign's driver was late: {f.kind} for step {f.step} "
                           f"would act at step {now}")
    if f.kind == "damaged-newest":
        damage(job.run_dir)
    if f.kind == "lost-node":
        i = cl.node_of(pid)
        cl.sh("lose", cl.name, str(i))
        subprocess.run(["rm", "-rf", str(local / cl.node(i))], check=True)
        return
    os.kill(pid, signal.SIGSTOP if f.kind == "sigstop" else signal.SIGKILL)


def arm(faults: list[Fault]) -> str:
    """HPCTRAIN_FAULTS for the in-process kinds among ``faults``."""
    return ";".join([f"slow@*:1:{PACE_S}"] + [f"{IN_PROCESS[f.kind]}@{f.rank}:{f.step}"
                                               for f in faults if f.kind in IN_PROCESS])


def resumed_at(job: Job) -> int | None:
    line = next((x for x in job.lines if "] resumed from " in x), None)
    return int(line.rsplit("at step ", 1)[1].split()[0]) if line else None


def one_job(cl: Cluster, d: Path, mine: list[Fault], steps: int, first: bool) -> Job:
    """Start the job of ``mine`` (after a requeue: resuming), do its faults one after the
    other, each once the run recovered from the one before; return it ended."""
    fails = sum(f.kind in FAILS for f in mine)
    env = {**cl.env, "HPCTRAIN_FAULTS": arm(mine), "HPCTRAIN_FAULTS_ONCE": str(d / "once")}
    train = train_argv(d / "run", d / "local", steps)
    job = Job(cl, d / "run", job_argv(cl, fails + 1, 1, train + ([] if first else [
        "--set", "checkpoint.resume=auto"])), env)
    n = 0
    for f in mine:
        try:
            act(f, job, cl, d / "local")
            f.wall_s = -time.monotonic()  # completed below or by the next job's first step
            if f.kind in FAILS:
                n += 1
                job.wait_for(lambda k=n: job.failures >= k, 240, f"{f.kind} ending the step")
                job.wait_for(lambda k=n: job.recovered(k), 240, f"recovery from {f.kind}")
                f.wall_s += job.recovered_at[n]
            elif f.kind == "full-local":
                job.wait_for(lambda f=f: job.step() > f.step, 240, "the step after full-local")
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
            f.human = f"{type(e).__name__}: {e}"
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
            for pid in cl.ranks().values():  # the launcher's mpirun has its own session
                os.kill(pid, signal.SIGKILL)
            break
    return job


def faults_before(faults: list[Fault], j: int) -> Fault | None:
    """The preemption that ended job j - 1."""
    return next((f for f in faults if f.job == j - 1 and f.kind == "sigterm"), None)


def campaign(cl: Cluster, d: Path, faults: list[Fault], steps: int) -> list[dict]:
    """Every job of the campaign in turn; the jobs' records (exit, start -> first step,
    the step resumed from, the last step done)."""
    (d / "once").mkdir()
    jobs = []
    for j in range(faults[-1].job + 1 + (faults[-1].kind == "sigterm")):
        mine = [f for f in faults if f.job == j]
        job = one_job(cl, d, mine, steps, first=not jobs)
        try:
            rc = job.end()
        except subprocess.TimeoutExpired:
            os.killpg(job.proc.pid, signal.SIGKILL)
            rc = job.end()
        if jobs and faults_before(faults, j) and faults_before(faults, j).wall_s is not None:
            faults_before(faults, j).wall_s += job.first_step_at or job.t0
        jobs.append({"rc": rc, "start_s": (job.first_step_at or job.t0) - job.t0,
                     "resumed": resumed_at(job), "last": job.step(), "tail": job.tail()})
        # outside SLURM a stopped run exits 0 (no requeue is wanted), in a job 75
        preempted = bool(mine) and mine[-1].kind == "sigterm" and rc in (0, 75)
        if any(f.human for f in mine) or (rc != 0 and not preempted):
            bad = next((f for f in mine if f.human), mine[-1] if mine else faults[-1])
            bad.human = bad.human or f"job {j} ended with exit {rc}"
            break
        cl.quiet()
        cl.sh("heal", cl.name)  # the requeued job gets whole nodes again
    return jobs


def attribute(faults: list[Fault], jobs: list[dict], run_dir: Path) -> None:
    """Steps lost and recovery time of each fault: relaunch.jsonl's relaunches in order for
    the faults a relaunch follows; the next job's resume for a preemption."""
    try:
        rows = [json.loads(x) for x in (run_dir / "relaunch.jsonl").read_text().splitlines()]
    except OSError:
        rows = []
    relaunches = iter([r for r in rows if "relaunch" in r])
    for f in faults:
        if f.human:
            break
        if f.kind in FAILS:
            r = next(relaunches, None)
            if r is None or r.get("recover_s") is None:
                f.human = "no relaunch record"
                break
            f.lost, f.recover_s = r["steps_lost"], r["recover_s"]
        elif f.kind == "sigterm" and f.job + 1 < len(jobs):
            before, after = jobs[f.job], jobs[f.job + 1]
            f.lost = before["last"] - (after["resumed"] or 0)
            f.recover_s = after["start_s"]
        elif f.kind == "full-local":
            f.lost, f.wall_s = 0, None


def datasets(path: Path) -> dict:
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset)
                     else None)
    return out


def differences(a: Path, b: Path) -> list[str]:
    """The datasets of two runs' final checkpoints that are not byte for byte equal."""
    fa, fb = (datasets(r / "checkpoints" / (r / "checkpoints" / "latest").read_text().strip())
              for r in (a, b))
    out = sorted(set(fa) ^ set(fb))
    raw = [name for name in set(fa) & set(fb) if _bytes(fa[name]) != _bytes(fb[name])]
    return out + sorted(raw)


def _bytes(value) -> bytes:
    return value.tobytes() if hasattr(value, "tobytes") else bytes(value)


def uninterrupted(cl: Cluster, d: Path, steps: int) -> Path:
    """The same run without a fault, as 4 ranks on this machine: its numbers do not depend
    on where the ranks sit, and no simulated link can fail it."""
    run_dir = d / "reference"
    train = train_argv(run_dir, d / "ref-local", steps)
    job = Job(cl, run_dir, [sys.executable, "-m", "hpctrain", "launch", "-n", str(WORLD),
                            "--", *train], cl.env)
    if job.end():
        raise RuntimeError(f"the uninterrupted run failed:\n{job.tail()}")
    return run_dir


def bound(faults: list[Fault], i: int) -> int:
    """The steps fault i may cost: LOCAL_EVERY, or EVERY where a full local directory
    switched the tier off earlier in the same attempt."""
    before = faults[i - 1] if i else None
    off = before is not None and before.kind == "full-local" and before.job == faults[i].job
    return EVERY if off else LOCAL_EVERY


def summarize(out: dict, faults: list[Fault], diff: list[str] | None) -> None:
    lost = [f.lost for f in faults if f.lost is not None]
    rec = [f.recover_s for f in faults if f.recover_s is not None]
    wall = [f.wall_s for f in faults if f.lost is not None and f.wall_s is not None]
    over = [f"{f.kind} at step {f.step}: {f.lost} > {bound(faults, i)}"
            for i, f in enumerate(faults) if f.lost is not None and f.lost > bound(faults, i)]
    human = [f"{f.kind} at step {f.step}: {f.human}" for f in faults if f.human]
    survived = len([f for f in faults if f.lost is not None])
    kinds = {k: sum(f.kind == k for f in faults) for k in KINDS}
    out["rows"] += [row("recovery time per fault", rec or [0.0]),
                    row("fault -> first step after it", wall or [0.0]),
                    row("steps lost per fault", [float(x) for x in lost] or [0.0], "steps")]
    out["notes"] += [
        f"{survived} of {len(faults)} faults survived without a human "
        f"({', '.join(f'{k} {n}' for k, n in kinds.items() if n)})",
        f"steps lost per fault: max {max(lost, default=0)}, median {median(lost or [0]):g} "
        f"(local_every={LOCAL_EVERY}, every={EVERY})",
        f"recovery (failure detected -> first step done; a preemption: the next job's start "
        f"-> first step): median {median(rec or [0]):.1f} s, max {max(rec, default=0):.1f} s; "
        f"from the fault itself (the launcher noticing, the watchdog, the stop and save "
        f"included): median {median(wall or [0]):.1f} s, max {max(wall, default=0):.1f} s",
        f"needed a human: {'; '.join(human) or 'nothing'}",
        "final parameters and optimizer state vs the uninterrupted run: " + (
            "not compared (the run did not end by itself)" if diff is None else
            "byte for byte equal" if diff == [] else f"differ in {diff}")]
    out["notes"] += [f"cost more than allowed: {x}" for x in over]
    out["check"] = {"what": "faults survived, final state byte for byte, steps lost in bound",
                    "values": [survived, len(faults)], "rel_err": 0.0, "tol": 0.0,
                    "ok": not human and not over and diff == [] and survived == len(faults)}
    out["table"] = [{"kind": f.kind, "step": f.step, "rank": f.rank, "job": f.job,
                     "steps_lost": f.lost, "recover_s": f.recover_s, "wall_s": f.wall_s,
                     "human": f.human}
                    for f in faults]


def run(world, size: str, repeats: int) -> dict:
    n, seed = COUNT[size], int(os.environ.get("HPCTRAIN_FAULT_SEED", "1"))
    out = result("faults", world, size, repeats,
                 f"{n} faults (seed {seed}) on 3 simulated nodes x {SLOTS} ranks (2 used, 1 "
                 f"spare), dp=2 x pp=2, float64, HDF5 every {EVERY}, local tier every "
                 f"{LOCAL_EVERY}, under hpctrain launch --relaunch")
    if world.rank != 0:
        return out
    check = subprocess.run([SCRIPT, "check"], capture_output=True, text=True)
    if check.returncode:
        out["notes"].append(f"not run: no simulated cluster here ({check.stderr.strip()})")
        return out
    faults = draw(seed, n)
    steps = GAP * (n + 1) + 2
    cl = Cluster(f"f{os.getpid() % 10**6}")
    cl.sh("up", cl.name, str(NODES), str(SLOTS))
    try:
        with tempfile.TemporaryDirectory(prefix="hpct-faults-") as tmp:
            d = Path(tmp)
            jobs = campaign(cl, d, faults, steps)
            attribute(faults, jobs, d / "run")
            out["notes"] += [f"job {i}: exit {j['rc']}" for i, j in enumerate(jobs)
                             if any(f.human for f in faults)]
            done = not any(f.human for f in faults) and jobs[-1]["rc"] == 0
            diff = differences(d / "run", uninterrupted(cl, d, steps)) if done else None
            if not done:
                out["notes"].append("the last job's output:\n" + jobs[-1]["tail"])
    finally:
        cl.sh("down", cl.name)
    summarize(out, faults, diff)
    return out
