"""Running under SLURM: know the job, refuse a wrong launch, stop cleanly when preempted.

Three things, used by the CLI and ``train.py``:

* :func:`launch_error` -- ``None``, or a message when ``COMM_WORLD.size`` is not the number of
  tasks SLURM allocated (``SLURM_NTASKS``): typically ``python -m hpctrain train`` started
  without ``srun`` (one singleton world per process, each believing it is alone).
* :func:`attach` -- reads the job (id, array index, tasks, node-local id, restart count, end
  time), logs it, and installs SIGUSR1/SIGTERM/SIGINT handlers that only set a flag (a handler
  may run in the middle of an MPI call).
* :meth:`Job.stop_reason` -- at a step boundary all ranks agree (one 8-byte all-reduce of
  the flag over the world, through ``comm``) whether any rank was signalled; if so the loop
  stops like for any stop rule (checkpoint, break, close telemetry), and
  :meth:`Job.exit_if_stopped` ends the process with :data:`EXIT_REQUEUE` (the ``jobs/``
  templates turn it into ``scontrol requeue``), or returns (exit 0) when
  ``HPCTRAIN_REQUEUE=0``. The requeued job resumes from ``latest``
  (``checkpoint.resume=auto``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

EXIT_REQUEUE = 75  # sysexits' EX_TEMPFAIL: "try again later"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
WHY = {  # what each stop signal usually means, for the log
    signal.SIGUSR1: "preemption or time limit (sbatch --signal)",
    signal.SIGTERM: "preemption, time limit, scancel, or Ctrl-C passed on by mpirun",
    signal.SIGINT: "interrupted: Ctrl-C",
}
LAUNCH_HELP = (
    "launch one process per rank with srun (or mpirun inside the allocation), e.g.\n"
    "    srun --mpi={pmi} python -m mpi4py -m hpctrain train CONFIG --run-dir DIR\n"
    "  (see jobs/*.sbatch; `srun --mpi=list` shows the PMI plugins of this site)")

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def run_name(config: str | None, given: str = "") -> str:
    """A batch run's identity across submissions, which names its run directory (never the
    job id, so a resubmission or the next job of a chain continues the run): ``given``, else
    the config file's stem (``demo`` for demo.toml). ValueError for a name unfit for a path."""
    name = given or (os.path.splitext(os.path.basename(config))[0] if config else "hpctrain")
    if not RUN_NAME.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits and . _ + - (it names the "
                         "run directory); set RUN_NAME or --run-name")
    return name


def srun_pmi(library: str) -> str:
    """srun's PMI plugin for an MPI library (``MPI_Get_library_version``): pmix for Open MPI,
    pmi2 for the MPICH family (MPICH, Intel MPI, MVAPICH; Cray MPICH: cray_shasta)."""
    if "CRAY MPICH" in library.upper():
        return "cray_shasta"
    return "pmix" if "Open MPI" in library or not library else "pmi2"


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def launch_error(world_size: int, library: str = "") -> str | None:
    """Why this launch is wrong, or None. Pure (no MPI): every rank reaches the same verdict;
    ``library`` (the MPI's version string) picks the srun plugin the message suggests.

    Inside a SLURM job step ``SLURM_NTASKS`` is the number of tasks srun started; ranks that
    each see a world of a different size were not wired together by PMI."""
    ntasks = _env_int("SLURM_NTASKS")
    if ntasks is None or ntasks == world_size:
        return None
    return (f"SLURM allocated {ntasks} tasks (SLURM_NTASKS) but this MPI world has "
            f"{world_size} rank(s): the processes were started as MPI singletons (or by a "
            f"launcher that does not know the allocation), so they would train independent "
            f"copies.\n  Fix: {LAUNCH_HELP.format(pmi=srun_pmi(library))}")


@dataclass
class Job:
    """The SLURM job this rank runs in (all fields None/0 outside SLURM)."""

    job_id: str | None = None
    array: str | None = None  # "ARRAY_JOB_ID_TASK_ID" for an array element
    ntasks: int | None = None
    nnodes: int | None = None
    local_id: int | None = None  # node-local task id (SLURM_LOCALID)
    restart_count: int = 0  # how often SLURM requeued this job
    end_time: str | None = None  # when the time limit ends the job
    requeue: bool = False  # exit with EXIT_REQUEUE (True) or 0 when asked to stop
    _flag: int = 0  # signal number that asked us to stop (set by the handler)
    stopped: bool = False  # a signal ended the loop (all ranks agreed)
    interrupted: bool = False  # ... and it was SIGINT (Ctrl-C): no requeue
    rank: int = 0  # world rank (rank 0 prints)
    _previous: dict = field(default_factory=dict)  # signal -> handler before install

    @classmethod
    def from_env(cls) -> Job:
        e = os.environ
        array = (f"{e['SLURM_ARRAY_JOB_ID']}_{e.get('SLURM_ARRAY_TASK_ID', '')}"
                 if "SLURM_ARRAY_JOB_ID" in e else None)
        job_id = e.get("SLURM_JOB_ID")
        default_requeue = "1" if job_id else "0"
        return cls(job_id=job_id, array=array, ntasks=_env_int("SLURM_NTASKS"),
                   nnodes=_env_int("SLURM_JOB_NUM_NODES"), local_id=_env_int("SLURM_LOCALID"),
                   restart_count=_env_int("SLURM_RESTART_COUNT", 0) or 0,
                   end_time=e.get("SLURM_JOB_END_TIME"),
                   requeue=e.get("HPCTRAIN_REQUEUE", default_requeue) == "1")

    def describe(self) -> str:
        if not self.job_id:
            return ("not a SLURM job; SIGUSR1/SIGTERM/SIGINT (Ctrl-C) checkpoint and stop at "
                    "a step boundary")
        array = f" (array element {self.array})" if self.array else ""
        on_stop = f"exit {EXIT_REQUEUE} -> requeue" if self.requeue else "exit 0"
        return (f"SLURM job {self.job_id}{array}: {self.ntasks} tasks on {self.nnodes} "
                f"node(s), restart count {self.restart_count}, ends {self.end_time or '?'}; "
                f"on SIGUSR1/SIGTERM: checkpoint, {on_stop}; on SIGINT (Ctrl-C): "
                "checkpoint, exit 0")

    # -- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self._flag = signum  # only a flag: we may be inside MPI or HDF5 right now

    def install_handlers(self) -> None:
        """Main thread only (Python's rule); elsewhere signals keep their handlers."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def restore_handlers(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def stop_reason(self, world, step: int, total: int) -> str | None:
        """Collective over ``world`` (one 8-byte all-reduce, skipped on every rank alike at the
        last step): why to stop after step ``step``, on every rank when any rank was
        signalled, else None. The loop then checkpoints and leaves as for any stop rule."""
        if step >= total:
            return None  # the run ends here anyway: nothing to requeue
        signum = int(world.allreduce(float(self._flag), op="max"))
        if not signum:
            return None
        self.stopped = True
        self.interrupted = signum == signal.SIGINT  # checkpointed, but not requeued
        return f"signal {signal.Signals(signum).name} ({WHY[signal.Signals(signum)]})"

    def exit_if_stopped(self) -> None:
        """After the loop and its checkpoint: when a signal stopped the run and a requeue is
        wanted, finalise MPI and end the process with EXIT_REQUEUE (a non-zero ``sys.exit``
        under ``python -m mpi4py`` would MPI_Abort instead). Otherwise restore the previous
        signal handlers and return. Collective."""
        if not (self.stopped and self.requeue) or self.interrupted:
            self.restore_handlers()
            return
        from .. import comm

        if self.rank == 0:
            print(f"[hpctrain] exiting with {EXIT_REQUEUE}: the job script requeues the job, "
                  "which resumes from the latest checkpoint", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        comm.finalize()
        os._exit(EXIT_REQUEUE)


def _end_time(job_id: str) -> str | None:
    """The job's end time from squeue (older SLURMs do not export SLURM_JOB_END_TIME)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def attach(world, info) -> Job:
    """Read the SLURM job, log it through ``info`` (rank 0's log) and install the stop
    handlers. Not collective. (The GPU is chosen from the node-local rank in ``gpu.py``.)"""
    job = Job.from_env()
    job.rank = world.rank
    if job.job_id and not job.end_time and world.rank == 0:
        job.end_time = _end_time(job.job_id)
    job.install_handlers()
    info(job.describe())
    return job


def parse_end_time(value) -> float | None:
    """SLURM end time as epoch seconds; given as epoch seconds or as 'YYYY-MM-DDTHH:MM:SS'."""
    if not value:
        return None
    text = str(value).strip()
    if text.isdigit():
        return float(text)
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
