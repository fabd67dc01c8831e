"""The batch job before the queue, as a user types it on a login node: jobs/dry-run.sh runs
the template itself up to the job step, and ``hpctrain submit`` submits only what passes.
No SLURM needed (a stand-in ``sbatch`` records what it was given); the jobs themselves run
on the real SLURM in test_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from launch import PY, ROOT, TINY, env

pytestmark = pytest.mark.e2e

LLAMA8B = str(ROOT / "share/configs/llama3-8b.toml")


def dry_run(cwd: Path, *line: str, **variables) -> subprocess.CompletedProcess:
    """jobs/dry-run.sh LINE from ``cwd`` (not the checkout), hpctrain found from PYTHON."""
    e = env(PYTHON=PY, XDG_CONFIG_HOME=cwd / "xdg", SCRATCH=cwd / "scratch", **variables)
    e.pop("HPCTRAIN_ROOT", None)
    return subprocess.run(["bash", str(ROOT / "jobs/dry-run.sh"), *line], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=120)


def test_the_config_layout_is_kept_on_its_own_task_count(tmp_path):
    """llama3-8b's dp=8 x tp=4 on 4 nodes x 8 tasks: the template keeps it (it used to set
    topology.dp to the task count and fail on the compute node)."""
    proc = dry_run(tmp_path, "--nodes=4", "--ntasks-per-node=8",
                   str(ROOT / "jobs/multi-node.sbatch"), LLAMA8B)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "layout dp=8 (ep=1) x tp=4 x pp=1 x cp=1 = 32 ranks" in out, out
    run_dir = tmp_path / "scratch/hpctrain-runs/llama3-8b"
    assert f"run directory {run_dir}: new run" in out, out
    assert "account (site default)" in out and "run llama3-8b" in out, out
    assert not run_dir.exists(), "a dry run wrote the run directory"


def test_a_layout_that_cannot_fit_is_refused_before_the_queue(tmp_path):
    proc = dry_run(tmp_path, "--ntasks-per-node=3", str(ROOT / "jobs/single-node.sbatch"),
                   LLAMA8B)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs 32 ranks but the job has 3 tasks" in proc.stderr, proc.stderr
    assert proc.stderr.count("needs 32 ranks") == 1  # one message
    proc = dry_run(tmp_path, "--ntasks-per-node=3", str(ROOT / "jobs/single-node.sbatch"),
                   TINY, LAYOUT="topology.tp=2")
    assert proc.returncode == 2 and "tp * pp * cp = 2 does not divide the job's 3" in \
        proc.stderr, proc.stderr


def test_submitted_elsewhere_relative_paths_resolve_in_the_submit_directory(tmp_path):
    """From a project directory (not the checkout): a relative config path, the site file in
    its per-user place (its account and modules), an open dp filled in, the run named."""
    (tmp_path / "cfg").mkdir()
    shutil.copy(TINY, tmp_path / "cfg/mine.toml")
    site = tmp_path / "xdg/hpctrain/site.sh"
    site.parent.mkdir(parents=True)
    site.write_text("export SBATCH_ACCOUNT=proj7\nHPCTRAIN_MODULES='fake-mpi/1'\n"
                    "module() { :; }\n")
    proc = dry_run(tmp_path, "--ntasks-per-node=2", str(ROOT / "jobs/preemptible.sbatch"),
                   "cfg/mine.toml", "--run-name", "exp1", "--set", "train.steps=3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "account proj7" in out and "modules fake-mpi/1" in out, out
    assert "layout dp=2 (ep=1) x tp=1 x pp=1 x cp=1 = 2 ranks" in out, out
    assert f"run directory {tmp_path}/scratch/hpctrain-runs/exp1: new run" in out, out


def test_submit_submits_only_what_passes(tmp_path):
    fake = tmp_path / "bin/sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/submitted\necho 17\n')
    fake.chmod(0o755)
    e = env(PYTHON=PY, SCRATCH=tmp_path / "scratch", XDG_CONFIG_HOME=tmp_path / "xdg",
            PATH=f"{fake.parent}:{os.environ['PATH']}")
    template = str(ROOT / "jobs/single-node.sbatch")
    bad = subprocess.run([PY, "-m", "hpctrain", "submit", "--ntasks-per-node=3", template,
                          LLAMA8B], cwd=tmp_path, env=e, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "not submitted" in bad.stderr, bad.stderr
    assert not (tmp_path / "submitted").exists()
    line = ["--ntasks-per-node=2", "--time=00:10:00", template, TINY, "--set",
            "checkpoint.dir=/tmp/a b"]
    good = subprocess.run([PY, "-m", "hpctrain", "submit", *line], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "17" in good.stdout
    assert (tmp_path / "submitted").read_text().splitlines() == line  # the same line, whole
