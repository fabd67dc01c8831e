"""The jobs/ templates against a real local SLURM (scripts/slurm.sh): no mocks.

The module fixture starts slurmctld + slurmd for this host (installing Debian's slurm-wlm and
munge when missing) and submits the long-running jobs at once so they overlap; each test then
waits for its job. The tiny preset in float64 on 2 ranks; the preempted run is compared step
by step with the uninterrupted single-node run (same layout, same steps).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from launch import LAUNCHER, PY, ROOT, TINY, assert_same, env, read_run

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

SCRIPT = str(ROOT / "scripts/slurm.sh")
STEPS = 12  # long enough to signal the preemptible job mid-run after polling its metrics
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _slurm_cmd(*args: str, timeout: float = 30) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}: {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def slurm():
    """A running single-host SLURM; stopped afterwards unless it was up before."""
    was_up = subprocess.run(["bash", SCRIPT, "status"], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", SCRIPT, "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        can_install = os.geteuid() == 0 and shutil.which("apt-get") is not None
        if can_install or shutil.which("sbatch"):  # it should have worked: a real failure
            pytest.fail(f"scripts/slurm.sh start failed:\n{proc.stdout}\n{proc.stderr}")
        pytest.skip("SLURM is not installed and cannot be (needs root and apt-get): "
                    + proc.stderr.strip().splitlines()[-1])
    yield
    if not was_up:
        subprocess.run(["bash", SCRIPT, "stop"], capture_output=True, timeout=120)


def job_env(**extra) -> dict:
    # CPU_BIND empty: the test cluster has no task/affinity plugin (srun would warn).
    return env(HPCTRAIN_ROOT=ROOT, PYTHON=PY, CPU_BIND="", **extra)


def sbatch(out_dir: Path, script: str, *args: str, after: tuple = (), site: Path | None = None,
           **variables) -> str:
    """Submit ``script`` from the checkout with ``variables`` in its environment and
    ``after`` as the script's arguments (``site``: sourced first, as a user does); job id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", "-o", str(out_dir / "slurm-%j.out"), *args, script, *after]
    if site:
        cmd = ["bash", "-c", 'source "$0" && exec "$@"', str(site), *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(**variables), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def job_records(job_id: str) -> list[dict]:
    """``scontrol show job -o`` as dicts, one per job (array elements each)."""
    out = _slurm_cmd("scontrol", "show", "job", "-o", job_id)
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line]


def wait_for(job_id: str, timeout: float = 240) -> list[dict]:
    """Poll until every record of the job is in a terminal state; returns the records."""
    deadline = time.monotonic() + timeout
    while True:
        records = job_records(job_id)
        if records and all(r["JobState"] in TERMINAL for r in records):
            return records
        assert time.monotonic() < deadline, f"job {job_id} not done in {timeout} s: {records}"
        time.sleep(0.5)


def output_of(out_dir: Path, job_id: str) -> str:
    return "\n".join(p.read_text() for p in sorted(out_dir.glob(f"slurm-{job_id}*.out")))


def assert_completed(records: list[dict], out_dir: Path) -> None:
    for r in records:
        assert r["JobState"] == "COMPLETED" and r["ExitCode"] == "0:0", (
            f"job {r['JobId']}: {r['JobState']} exit {r['ExitCode']}\n"
            + output_of(out_dir, r["JobId"])[-6000:])


@pytest.fixture(scope="module")
def submitted(slurm, tmp_path_factory):
    """Jobs submitted together at the start (they overlap): name -> (job id, dir)."""
    d = tmp_path_factory.mktemp("slurm")
    jobs = {
        "single": (d / "single", "jobs/single-node.sbatch", ["--ntasks-per-node=2"],
                   dict(CONFIG=TINY, OVERRIDES=f"train.steps={STEPS}")),
        "multi": (d / "multi", "jobs/multi-node.sbatch", ["--nodes=1", "--ntasks-per-node=2"],
                  dict(LAYOUT="topology.tp=2", after=(TINY, "--set", "train.steps=2"))),
        "sweep": (d / "sweep", "jobs/sweep.sbatch", ["--array=0-2", "--ntasks-per-node=1"],
                  dict(CONFIG=TINY, KEY="optim.lr", VALUES="1e-3 2e-3 4e-3",
                       OVERRIDES="train.steps=2")),
    }
    jobs["site"] = (d / "site", "jobs/gpu.sbatch",  # a GPU template on the GPU-less node
                    ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=2"],
                    dict(CONFIG=TINY, SCRATCH="", HPCTRAIN_SITE=_site_file(d / "site"),
                         site=d / "site/site.sh", RUN_DIR="",
                         OVERRIDES=f'train.steps=2 "checkpoint.dir={d}/site/my ckpts"'))
    jobs["no_export"] = (d / "no_export", "jobs/single-node.sbatch",
                         ["--export=NONE", "--ntasks-per-node=2"],
                         dict(after=(TINY, "--set", "train.steps=2", "--run-dir",
                                     str(d / "no_export/run"))))
    for name in ("local", "no_local"):  # relaunched from the local tier / it deleted
        jobs[f"relaunch_{name}"] = (
            d / name, "jobs/relaunch.sbatch", ["--nodes=1", "--ntasks-per-node=2"],
            dict(CONFIG=TINY, HPCTRAIN_RELAUNCHES="1",
                 OVERRIDES=f"train.steps={STEPS} checkpoint.every=2 checkpoint.local_every=1 "
                           f'"checkpoint.local_dir={d / name}/local/{{node}}"'))
    jobs["singletons"] = (d / "singletons", str(_singletons_script(d / "singletons")),
                          ["--ntasks=2"], {})
    out = {}
    chain = d / "chain"  # two jobs of a chain, one run: named, no RUN_DIR, no job id in it
    first = sbatch(chain, "jobs/single-node.sbatch", "--ntasks-per-node=2",
                   after=(TINY, "--run-name", "chained"), RUN_DIR="", SCRATCH=chain / "scratch",
                   OVERRIDES=f"train.steps={STEPS // 2} optim.decay_steps={STEPS}")
    second = sbatch(chain, "jobs/single-node.sbatch", f"--dependency=afterany:{first}",
                    "--ntasks-per-node=2", after=(TINY, "--run-name", "chained"), RUN_DIR="",
                    SCRATCH=chain / "scratch",
                    OVERRIDES=f"train.steps={STEPS} optim.decay_steps={STEPS}")
    out["chain"] = ((first, second), chain)
    for name, (jd, script, args, variables) in jobs.items():
        variables.setdefault("RUN_DIR", str(jd / "run"))
        if name == "no_export":  # the job's own environment finds the checkout's .venv only
            assert (ROOT / ".venv/bin/python").exists(), "make setup creates the checkout's .venv"
            variables.pop("RUN_DIR")
        if name == "sweep":
            variables["RUN_ROOT"] = str(jd / "run")
        after, site = variables.pop("after", ()), variables.pop("site", None)
        out[name] = (sbatch(jd, script, *args, after=after, site=site, **variables), jd)
    return out


def _poll_steps(run_dir: Path, n: int, job_id: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        state = job_records(job_id)[0]["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state} early"
        assert time.monotonic() < deadline, f"job {job_id}: no {n} steps in {timeout} s"
        time.sleep(0.1)


def _wait_requeued(job_id: str, timeout: float = 120) -> None:
    """Until SLURM has requeued the job (it starts again after AuthInfo=cred_expire, 10 s
    on the test cluster; starting it earlier fails with "Job credential revoked")."""
    deadline = time.monotonic() + timeout
    while True:
        r = job_records(job_id)[0]
        if int(r["Restarts"]) >= 1:
            return
        assert r["JobState"] not in TERMINAL, f"job {job_id} ended instead of requeueing: {r}"
        assert time.monotonic() < deadline, f"job {job_id} not requeued: {r}"
        time.sleep(0.2)


def _failed_logged(d: Path, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while "[relaunch] step failed" not in output_of(d, job_id):
        assert time.monotonic() < deadline, output_of(d, job_id)[-4000:]
        time.sleep(0.05)


@pytest.mark.slow(reason="two SLURM jobs, each killing and relaunching a step")
def test_a_killed_step_is_relaunched_inside_the_job(submitted):
    """jobs/relaunch.sbatch: the training step killed mid-run (scancel JOB.0) is probed and
    relaunched in the same job (no requeue); it resumes from the node-local tier, or, with
    that deleted before the relaunch, from the HDF5 file. Both runs equal the uninterrupted
    one (float64, rel 1e-9), every step once."""
    jobs = {name: submitted[f"relaunch_{name}"] for name in ("local", "no_local")}
    for job_id, d in jobs.values():
        _poll_steps(d / "run", 3, job_id)
        _slurm_cmd("scancel", "--signal=KILL", f"{job_id}.0")
    job_id, d = jobs["no_local"]
    _failed_logged(d, job_id)  # the step is gone; the relaunch has not started
    shutil.rmtree(d / "local")
    ref_id, ref_dir = submitted["single"]
    assert_completed(wait_for(ref_id), ref_dir)
    for name, (job_id, d) in jobs.items():
        records = wait_for(job_id)
        assert_completed(records, d)
        assert records[0]["Restarts"] == "0", "requeued instead of relaunched inside the job"
        out = output_of(d, job_id)
        assert "[relaunch] step failed" in out and "relaunch 1/1 on " in out, out[-6000:]
        assert "the configured layout" in out  # the node survived: same ranks, same layout
        assert re.search(r"relaunch 1: first step done [\d.]+ s after", out), out[-6000:]
        tier = re.search(r"restart: tier (\w+), step (\d+)", out)
        assert tier and tier.group(1) == ("local" if name == "local" else "hdf5"), out[-6000:]
        assert int(tier.group(2)) >= 2  # a step saved before the kill (HDF5: every 2)
        run = read_run(d / "run")
        assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1)), name
        assert_same(run, read_run(ref_dir / "run"), 1e-9, f"relaunched ({name}) vs uninterrupted")


@pytest.mark.slow(reason="a SLURM job preempted, requeued and resumed")
def test_preemption_requeues_and_resumes_exactly(submitted, tmp_path):
    """USR1 mid-run -> checkpoint, exit 75, scontrol requeue, resume from latest: the losses,
    grad norms and final parameters equal the uninterrupted run's (float64, rel 1e-9)."""
    run_dir = tmp_path / "run"
    job_id = sbatch(tmp_path, "jobs/preemptible.sbatch", "--ntasks-per-node=2",
                    CONFIG=TINY, RUN_DIR=str(run_dir), OVERRIDES=f"train.steps={STEPS}")
    _poll_steps(run_dir, 2, job_id)
    _slurm_cmd("scancel", "--signal=USR1", "--batch", job_id)
    _wait_requeued(job_id)
    records = wait_for(job_id)
    assert_completed(records, tmp_path)
    assert records[0]["Restarts"] == "1"

    log = (run_dir / "train.log").read_text()
    stopped = re.search(r"stopping at step (\d+): signal SIGUSR1", log)
    assert stopped, log
    k = int(stopped.group(1))
    assert 2 <= k < STEPS, f"stopped at step {k}: not mid-run"
    assert re.search(rf"resumed from \S+step_{k:08d}.h5 at step {k}\b", log), log
    assert "restart count 1" in log
    assert "exiting with 75" in output_of(tmp_path, job_id)
    run = read_run(run_dir)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1)), "a step lost/redone"

    ref_id, ref_dir = submitted["single"]
    assert_completed(wait_for(ref_id), ref_dir)
    assert_same(run, read_run(ref_dir / "run"), 1e-9, "preempted + requeued vs uninterrupted")


@pytest.mark.slow(reason="two chained SLURM jobs, the second after the first")
def test_a_job_chain_continues_one_run(submitted):
    """sbatch --dependency=afterany: the second job of the chain continues the first's run
    from its last checkpoint (the run directory is the run's name, not a job id): together
    they equal the uninterrupted run (float64, rel 1e-9)."""
    (first, second), d = submitted["chain"]
    assert_completed(wait_for(first), d)
    assert_completed(wait_for(second, timeout=300), d)
    run_dir = d / "scratch/hpctrain-runs/chained"
    log = (run_dir / "train.log").read_text()
    assert re.search(rf"resumed from \S+step_{STEPS // 2:08d}.h5 at step {STEPS // 2}\b",
                     log), log
    run = read_run(run_dir)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1)), "a step lost/redone"
    ref_id, ref_dir = submitted["single"]
    assert_completed(wait_for(ref_id), ref_dir)
    assert_same(run, read_run(ref_dir / "run"), 1e-9, "a chain of two jobs vs one job")


def test_single_node_trains(submitted):
    job_id, d = submitted["single"]
    assert_completed(wait_for(job_id), d)
    run = read_run(d / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in run.losses)
    assert run.losses[-1] < run.losses[0] - 0.5, run.losses  # it learns
    log = (d / "run/train.log").read_text()
    assert f"SLURM job {job_id}: 2 tasks on 1 node(s), restart count 0" in log


def _singletons_script(d: Path) -> Path:
    """A batch script that starts two `python -m hpctrain train` without srun: two MPI
    singletons (world size 1) in a 2-task allocation, the classic launch mistake."""
    d.mkdir(parents=True, exist_ok=True)
    cmd = f"{PY} -m mpi4py -m hpctrain train {TINY} --run-dir {d}/run --set topology.dp=2"
    script = d / "singletons.sh"
    script.write_text("#!/bin/bash\n"
                      f"{cmd} > {d}/r0.txt 2>&1 & p0=$!\n"
                      f"{cmd} > {d}/r1.txt 2>&1 & p1=$!\n"
                      "wait $p0; r0=$?; wait $p1; r1=$?\n"
                      'echo "exit codes $r0 $r1"\n')
    return script


def test_singletons_refused(submitted):
    """Both singletons (size 1 != SLURM_NTASKS=2) stop before training, saying how to launch."""
    job_id, d = submitted["singletons"]
    wait_for(job_id, timeout=120)
    out = output_of(d, job_id)
    codes = re.search(r"exit codes (\d+) (\d+)", out)
    assert codes and codes.group(1) != "0" and codes.group(2) != "0", out
    for r in ("r0", "r1"):
        text = (d / f"{r}.txt").read_text()
        assert "SLURM allocated 2 tasks (SLURM_NTASKS) but this MPI world has 1 rank" in text, text
        assert f"srun --mpi={'pmix' if LAUNCHER.family == 'openmpi' else 'pmi2'}" in text, text
    assert not (d / "run/metrics.jsonl").exists(), "singletons started training"


def test_multi_node_template_runs(submitted):
    job_id, d = submitted["multi"]
    assert_completed(wait_for(job_id), d)
    run = read_run(d / "run")
    assert len(run.metrics) == 2 and all(math.isfinite(x) for x in run.losses)
    assert "grid (pp, dp_outer, ep, cp, tp) = (1, 1, 1, 1, 2)" in (d / "run/train.log").read_text()


def test_sweep_array_runs_each_value(submitted):
    job_id, d = submitted["sweep"]
    records = wait_for(job_id)
    assert len(records) == 3
    assert_completed(records, d)
    second_losses = set()
    for value in ("1e-3", "2e-3", "4e-3"):
        run_dir = d / "run" / f"optim.lr={value}"
        assert re.search(rf"^lr = {float(value)!r}$", (run_dir / "config.toml").read_text(),
                         re.M), value
        second_losses.add(read_run(run_dir).losses[1])
    assert len(second_losses) == 3, "the sweep values did not reach the runs"


def test_dry_run_template_plans():
    """jobs/dry-run.sh on the login node (no job): the template runs up to its job step,
    then the checks and the plan of the world its line would start, with LAYOUT."""
    proc = subprocess.run(["bash", "jobs/dry-run.sh", "--ntasks-per-node=4",
                           "jobs/single-node.sbatch", TINY], cwd=ROOT, capture_output=True,
                          text=True, env=job_env(LAYOUT="topology.tp=2 topology.dp=2"),
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "4 tasks on 1 node(s)" in out, out
    assert "4 ranks: dp=2 (ep=1) x tp=2 x pp=1" in out, out  # the job's world size, LAYOUT


def _site_file(d: Path) -> Path:
    """A site file as a user fills it in: account, partition, QOS, scratch, a module load
    (a stand-in ``module`` that records its arguments)."""
    d.mkdir(parents=True, exist_ok=True)
    site = d / "site.sh"
    site.write_text("export SBATCH_ACCOUNT=hpctrain-test SBATCH_PARTITION=debug "
                    "SBATCH_QOS=normal\n"
                    f"HPCTRAIN_SCRATCH={d}/scratch\n"
                    f'module() {{ echo "module $*" >> {d}/modules.txt; }}\n'
                    "module load fake-mpi/1.0 fake-hdf5/1.14\n")
    return site


def test_site_file_account_scratch_and_spaced_override(submitted):
    """The site file's account and partition reach SLURM, its module line runs in the job,
    the run goes to its scratch, and an OVERRIDES value with a space arrives whole."""
    job_id, d = submitted["site"]
    records = wait_for(job_id)
    assert_completed(records, d)
    assert records[0]["Account"] == "hpctrain-test" and records[0]["Partition"] == "debug"
    assert "module load fake-mpi/1.0 fake-hdf5/1.14" in (d / "modules.txt").read_text()
    run_dir = d / "scratch/hpctrain-runs" / Path(TINY).stem  # the run's name, not the job's
    assert len(read_run(run_dir).metrics) == 2
    assert list((d / "my ckpts").glob("step_*.h5")), "checkpoint.dir with a space was split"
    out = output_of(d, job_id)
    assert "0 GPU(s) per node" in out and "device cpu" in out, out  # no GPUs: cpu
    assert "warning" not in out, out  # scratch from the site file, no GPU rank starved


def test_export_none_keeps_the_config(submitted):
    """Under --export=NONE (no variables reach the job) the config and overrides given as
    arguments train, and srun still hands the ranks the job's environment."""
    job_id, d = submitted["no_export"]
    assert_completed(wait_for(job_id), d)
    run_dir = d / "run"
    assert len(read_run(run_dir).metrics) == 2
    assert f"-> {run_dir}" in output_of(d, job_id)  # --run-dir as an argument sets RUN_DIR
    assert re.search(r"^d_model = 32$", (run_dir / "config.toml").read_text(), re.M)  # TINY
