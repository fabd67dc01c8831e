"""SIGUSR1 outside SLURM (mpirun forwards it to every rank): the ranks agree at a step
boundary, write a checkpoint and exit 0 (no requeue wanted). The SLURM round trip with
requeue is tests/e2e/test_slurm.py."""

import re
import signal

import pytest
from launch import signal_after_steps

pytestmark = pytest.mark.e2e


def test_sigusr1_checkpoints_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    # mpirun forwards SIGUSR1 to the ranks
    returncode, out = signal_after_steps(run_dir, 2, "topology.dp=2", "train.steps=40")
    metrics = run_dir / "metrics.jsonl"
    assert returncode == 0, out
    stop = re.search(r"stopping at step (\d+): signal SIGUSR1 \(preemption or time limit "
                     r"\(sbatch --signal\)\); "
                     r"checkpoint \S+", out)
    assert stop and "exiting with 75" not in out, out
    k = int(stop.group(1))
    assert 2 <= k < 40, k
    assert (run_dir / "checkpoints/latest").read_text().strip() == f"step_{k:08d}.h5"
    assert len(metrics.read_text().splitlines()) == k


def test_ctrl_c_checkpoints_and_is_named(tmp_path):
    """Ctrl-C at the launcher (SIGINT to mpirun, which passes it on to the ranks as SIGTERM;
    a rank started alone sees SIGINT): a checkpoint at a step boundary, the signal named,
    no requeue."""
    run_dir = tmp_path / "run"
    returncode, out = signal_after_steps(run_dir, 2, "topology.dp=2", "train.steps=40",
                                         sig=signal.SIGINT)
    stop = re.search(r"stopping at step (\d+): signal (SIGTERM \(preemption, time limit, "
                     r"scancel, or Ctrl-C passed on by mpirun\)|SIGINT \(interrupted: Ctrl-C\))",
                     out)
    assert stop and "exiting with 75" not in out, out
    k = int(stop.group(1))
    assert (run_dir / "checkpoints/latest").read_text().strip() == f"step_{k:08d}.h5"
