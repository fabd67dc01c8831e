"""hpctrain.job.slurm without MPI or SLURM: the launch check, the job read from the environment,
and the signal flag. (The real thing, sbatch and requeue, is tests/e2e/test_slurm.py.)"""

import os
import signal

import pytest

from hpctrain.job import slurm

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
              "SLURM_JOB_NUM_NODES", "SLURM_LOCALID", "SLURM_RESTART_COUNT",
              "SLURM_JOB_END_TIME", "HPCTRAIN_REQUEUE")


@pytest.fixture
def no_slurm(monkeypatch):
    for v in SLURM_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_launch_error_only_when_the_world_is_not_the_allocation(no_slurm):
    assert slurm.launch_error(1) is None  # not in SLURM
    no_slurm.setenv("SLURM_NTASKS", "4")
    assert slurm.launch_error(4) is None
    msg = slurm.launch_error(1)
    assert "SLURM allocated 4 tasks" in msg and "1 rank(s)" in msg and "singletons" in msg
    assert "srun --mpi=pmix" in msg
    # the plugin the message suggests follows the MPI family
    assert "srun --mpi=pmix" in slurm.launch_error(1, "Open MPI v4.1.4, package: Debian")
    assert "srun --mpi=pmi2" in slurm.launch_error(1, "MPICH Version: 4.0.2")
    assert "srun --mpi=pmi2" in slurm.launch_error(1, "Intel(R) MPI Library 2021.10")
    assert "srun --mpi=cray_shasta" in slurm.launch_error(1, "MPI VERSION : CRAY MPICH 8.1.27")


def test_job_from_env(no_slurm):
    job = slurm.Job.from_env()
    assert job.job_id is None and not job.requeue and "not a SLURM job" in job.describe()
    for k, v in dict(SLURM_JOB_ID="42", SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2",
                     SLURM_LOCALID="3", SLURM_RESTART_COUNT="2", SLURM_ARRAY_JOB_ID="40",
                     SLURM_ARRAY_TASK_ID="1").items():
        no_slurm.setenv(k, v)
    job = slurm.Job.from_env()
    assert (job.job_id, job.ntasks, job.nnodes, job.local_id, job.restart_count, job.array) \
        == ("42", 8, 2, 3, 2, "40_1")
    assert job.requeue  # the default inside SLURM
    text = job.describe()
    assert "SLURM job 42 (array element 40_1): 8 tasks on 2 node(s), restart count 2" in text
    assert f"exit {slurm.EXIT_REQUEUE} -> requeue" in text
    no_slurm.setenv("HPCTRAIN_REQUEUE", "0")
    assert not slurm.Job.from_env().requeue


class _World:
    """Stand-in for comm.Group: the all-reduce of one number over a world of one rank."""

    rank, size = 0, 1

    def allreduce(self, value, op="sum"):
        assert op == "max"
        return value


def test_signal_only_sets_the_flag(no_slurm):
    job = slurm.Job.from_env()
    old = {s: signal.getsignal(s) for s in slurm.SIGNALS}
    job.stopped = True  # exit_if_stopped must not exit: requeue is off outside SLURM
    job.install_handlers()
    job.exit_if_stopped()
    assert {s: signal.getsignal(s) for s in slurm.SIGNALS} == old  # restored
    job.stopped = False
    try:
        job.install_handlers()
        assert job.stop_reason(_World(), 1, 10) is None and not job.stopped
        os.kill(os.getpid(), signal.SIGUSR1)  # handled: the process survives
        assert job.stop_reason(_World(), 10, 10) is None  # the last step: nothing to stop
        assert "SIGUSR1" in job.stop_reason(_World(), 1, 10) and job.stopped
        job._flag = 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert "SIGTERM" in job.stop_reason(_World(), 1, 10)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
