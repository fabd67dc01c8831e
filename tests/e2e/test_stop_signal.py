"""SIGUSR1 outside SLURM (mpirun forwards it to every rank): the ranks agree at a step
boundary, write a checkpoint and exit 0 (no requeue wanted). The SLURM round trip with
requeue is tests/e2e/test_slurm.py."""

import os
import re
import signal
import subprocess
import time

import pytest
from launch import PY, ROOT, TINY, env

pytestmark = pytest.mark.e2e


def test_sigusr1_checkpoints_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["mpirun", "-n", "2", "--oversubscribe", PY, "-m", "mpi4py", "-m", "hpctrain",
           "train", TINY, "--run-dir", str(run_dir), "--set", "topology.dp=2",
           "--set", "train.steps=40"]
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no 2 steps in 120 s"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)  # mpirun forwards SIGUSR1 to the ranks
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    stop = re.search(r"stopping at step (\d+): signal SIGUSR1 \(preemption or time limit\); "
                     r"checkpoint \S+", out)
    assert stop and "exiting with 75" not in out, out
    k = int(stop.group(1))
    assert 2 <= k < 40, k
    assert (run_dir / "checkpoints/latest").read_text().strip() == f"step_{k:08d}.h5"
    assert len(metrics.read_text().splitlines()) == k
