"""How ranks are started: the one launcher abstraction of the checkout (tests, benchmarks,
``scripts/``, the Makefile, and users: ``hpctrain launch -n 8 -- CMD``). Standard library
only, so ``python3 -m hpctrain.job.launch`` works from a checkout before any virtual environment
exists.

Three launcher families, each with its flags for more ranks than cores, environment passing,
binding and a rank that dies (``keep_going``), and the environment a local launch needs:

* ``openmpi``: Open MPI ``mpirun`` / ``mpiexec``: ``--oversubscribe`` (and MCA variables),
  ``-x NAME``, ``--bind-to``, ``--enable-recovery``; run as root and yield when idle.
* ``hydra``: MPICH / Intel MPI / MVAPICH Hydra ``mpiexec`` (``mpiexec.mpich``): any number
  of local ranks as is, ``-genvlist A,B``, ``-bind-to``, ``-disable-auto-cleanup``.
* ``srun``: SLURM (``--mpi=`` as part of the command): ``--overcommit``, ``--export=ALL``,
  ``--cpu-bind``, ``--kill-on-bad-exit=0``.

Which launcher: ``HPCTRAIN_LAUNCHER`` (a command line, e.g. ``mpiexec.mpich`` or ``srun
--mpi=pmi2``) when set; else the ``mpiexec`` of the MPI library this interpreter's mpi4py
links (a source build: Debian's ``libmpich.so.12`` -> ``mpiexec.mpich``, a site's
``PREFIX/lib/libmpi.so`` -> ``PREFIX/bin/mpiexec``); else ``mpirun``. The family is read
from ``PROGRAM --version``.

From the shell::

    python -m hpctrain.job.launch --exports        # `export NAME=value` lines (mpi-env.sh)
    python -m hpctrain.job.launch --describe       # the launcher found, one line
    python -m hpctrain.job.launch -n 4 [--bind core] -- python -m mpi4py -m hpctrain ...
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHED_AT = "HPCTRAIN_LAUNCHED_AT"  # epoch seconds at which `launch` started the ranks

ROOT = Path(__file__).resolve().parents[2]  # the checkout (the package's parent)
# Not MPI settings but defaults of every local launch (the Makefile sets them too).
RUN_DEFAULTS = {"OMP_NUM_THREADS": "1", "HDF5_USE_FILE_LOCKING": "FALSE"}
# Open MPI's nonblocking all-reduce algorithm (libnbc; 3: Rabenseifner's reduce-scatter +
# all-gather), read at MPI_Init: set by the launch, and by hpctrain.cli before MPI starts.
LIBNBC_ALLREDUCE = ("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3")
# Open MPI on one machine: running as root (containers, CI); more ranks than cores (laptops,
# CI): idle ranks yield the CPU instead of spinning, and oversubscription is allowed (Open MPI
# 4: rmaps_base; Open MPI 5: PRRTE's mapping policy).
OPENMPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    # libnbc's nonblocking all-reduce (overlapped gradient reductions) as reduce-scatter +
    # all-gather (docs/decisions.md); hpctrain.cli sets it too where nothing did
    LIBNBC_ALLREDUCE[0]: LIBNBC_ALLREDUCE[1],
    # A rank proves itself to its node's PMIx server by the kernel's peer credentials, not
    # munge: a munge socket left behind by a stopped munged costs every launch 2.3 s of retries.
    "PMIX_MCA_psec": "native",
}
# Variables by which a launcher tells its ranks about their job: a process started inside
# one job that launches another (a simulated cluster) must drop them.
JOB_PREFIXES = ("OMPI_", "PMIX_", "OPAL_", "ORTE_", "PRTE_", "PMI_", "HYDRA_", "HYDI_",
                "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "MPIR_CVAR_CH3_INTERFACE_HOSTNAME")
FAMILIES = ("openmpi", "hydra", "srun")


@dataclass(frozen=True)
class Launcher:
    """One launcher: its family and the command that starts it (``program``)."""

    family: str
    program: tuple[str, ...]

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown launcher family {self.family!r}; one of {FAMILIES}")

    def argv(self, n: int, *, oversubscribe: bool = True, bind: str | None = None,
             export: tuple[str, ...] = (), keep_going: bool = False) -> list[str]:
        """The command line up to the program of each rank: ``n`` ranks; more ranks than
        cores allowed; ``bind`` ``core`` / ``none`` (None: the launcher's default);
        ``export``: variables to pass to remote ranks (local ranks inherit everything);
        ``keep_going``: a rank that dies does not end the others (the watchdog's case)."""
        cmd = [*self.program, "-n", str(n)]
        if self.family == "openmpi":
            cmd += ["--oversubscribe"] if oversubscribe else []
            cmd += ["--bind-to", bind] if bind else []
            for name in export:
                cmd += ["-x", name]
            cmd += ["--enable-recovery"] if keep_going else []
        elif self.family == "hydra":
            cmd += ["-bind-to", bind] if bind else []
            cmd += ["-genvlist", ",".join(export)] if export else []
            cmd += ["-disable-auto-cleanup"] if keep_going else []
        else:  # srun
            cmd += ["--overcommit"] if oversubscribe else []
            cmd += [f"--cpu-bind={'cores' if bind == 'core' else bind}"] if bind else []
            cmd += ["--export=ALL"]
            cmd += ["--kill-on-bad-exit=0"] if keep_going else []
        return cmd

    def env(self) -> dict[str, str]:
        """What a local launch needs on top of the caller's environment."""
        extra = OPENMPI_ENV if self.family == "openmpi" else {}
        return {**extra, **RUN_DEFAULTS}

    def with_program(self, program: tuple[str, ...]) -> Launcher:
        """The same family started differently (``scripts/cluster.sh mpirun NAME``)."""
        return Launcher(self.family, tuple(program))

    def describe(self) -> str:
        return f"{self.family} launcher: {shlex.join(self.program)}"


def family_of(version_text: str, program: str = "") -> str:
    """The family from ``PROGRAM --version`` output (or the program's name for srun)."""
    text = version_text.lower()
    if Path(program).name == "srun" or text.startswith("slurm"):
        return "srun"
    if "hydra" in text:  # MPICH, Intel MPI, MVAPICH: "HYDRA build details"
        return "hydra"
    if "open mpi" in text or "openrte" in text or "prte" in text or "open-mpi" in text:
        return "openmpi"
    raise RuntimeError(f"{program or 'the launcher'}: not Open MPI, Hydra or srun "
                       f"(--version says {version_text.strip()[:120]!r}); set "
                       "HPCTRAIN_LAUNCHER to one of them")


def mpi4py_library() -> str:
    """The MPI library this interpreter's mpi4py links, as ``ldd`` resolves it (a source
    build has one extension module; the binary wheel carries one per ABI and picks at run
    time: ""). Nothing is imported, so MPI is not initialised."""
    import importlib.util

    spec = importlib.util.find_spec("mpi4py")
    if spec is None or not spec.submodule_search_locations:
        return ""
    exts = sorted(Path(spec.submodule_search_locations[0]).glob("MPI.*.so"))
    if len(exts) != 1:
        return ""
    try:
        out = subprocess.run(["ldd", str(exts[0])], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.startswith(("libmpi.so", "libmpich.so", "libmpi_cray.so")):
            return where.split(" (")[0].strip() or name
    return ""


def default_program() -> tuple[str, ...]:
    """HPCTRAIN_LAUNCHER; else the mpiexec of the MPI library mpi4py links (Debian's
    ``libmpich.so.12`` -> ``mpiexec.mpich``; a site's ``/opt/x/lib/libmpi.so`` ->
    ``/opt/x/bin/mpiexec``); else mpirun."""
    if os.environ.get("HPCTRAIN_LAUNCHER"):
        return tuple(shlex.split(os.environ["HPCTRAIN_LAUNCHER"]))
    lib = mpi4py_library()
    if not lib:
        return ("mpirun",)
    family = "mpich" if ("mpich" in Path(lib).name or lib.endswith(".so.12")) else "openmpi"
    if shutil.which("mpiexec." + family):  # Debian's alternatives: both families installed
        return ("mpiexec." + family,)
    beside = Path(lib).resolve().parent.parent / "bin" / "mpiexec"
    return (str(beside),) if beside.exists() else ("mpirun",)


@functools.cache
def _detect(program: tuple[str, ...]) -> Launcher:
    if Path(program[0]).name == "srun":
        return Launcher("srun", program)
    try:
        proc = subprocess.run([program[0], "--version"], capture_output=True, text=True,
                              timeout=30)
    except FileNotFoundError:
        raise RuntimeError(f"launcher {program[0]!r} is not on the PATH") from None
    return Launcher(family_of(proc.stdout + proc.stderr, program[0]), program)


def detect(program: tuple[str, ...] | None = None) -> Launcher:
    """The launcher of this process (see the module docstring), cached per program."""
    return _detect(tuple(program or default_program()))


def cluster_program(script: str, name: str, launcher: Launcher | None = None) -> tuple:
    """The program that starts ranks over ``scripts/cluster.sh``'s simulated cluster NAME
    with this launcher's family (for :meth:`Launcher.with_program`): Open MPI's ``mpirun``,
    or Hydra's ``mpiexec`` (this launcher's own, through ``MPIEXEC``)."""
    how = launcher or detect()
    if how.family == "openmpi":
        return (script, "mpirun", name)
    if how.family == "hydra":
        return ("env", f"MPIEXEC={how.program[0]}", script, "mpiexec", name)
    raise RuntimeError("scripts/cluster.sh starts Open MPI's mpirun or Hydra's mpiexec; "
                       f"not {how.describe()}")


def command(n: int, *args: str, launcher: Launcher | None = None, **flags) -> list[str]:
    """``LAUNCHER -n N [flags] ARGS...``: see :meth:`Launcher.argv`."""
    return [*(launcher or detect()).argv(n, **flags), *args]


def launch_env(launcher: Launcher | None = None) -> dict[str, str]:
    """What a local launch needs on top of the caller's environment."""
    return (launcher or detect()).env()


def without_job(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the variables of the MPI job this process runs in."""
    return {k: v for k, v in env.items() if not k.startswith(JOB_PREFIXES)}


RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")  # Open MPI, Hydra, PMIx


def world_rank_of(env: dict[str, str]) -> int | None:
    """The world rank a launcher gave the process whose environment is ``env``, or None."""
    return next((int(env[k]) for k in RANK_VARS if env.get(k, "").isdigit()), None)


def nested_env() -> dict[str, str]:
    """The environment of a launch started from inside an MPI job (a simulated cluster's
    mpirun or mpiexec is a new job): this process's without the job's variables, plus the
    settings every local launch uses, the checkout first on PYTHONPATH."""
    return with_checkout({**without_job(dict(os.environ)), **launch_env()})


def with_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the checkout first on PYTHONPATH, so that processes started anywhere
    (mpirun's ranks) import ``benchmarks``."""
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exports", action="store_true", help="print `export NAME=value` lines")
    p.add_argument("--describe", action="store_true", help="print the launcher found")
    p.add_argument("-n", type=int, help="ranks: launch the command after -- (default: none; "
                   "needed unless --exports or --describe)")
    p.add_argument("--bind", choices=("core", "none"),
                   help="bind each rank to a core, or not (default: the launcher's own)")
    p.add_argument("--no-oversubscribe", action="store_true",
                   help="refuse more ranks than cores (by default they are allowed)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command every rank runs, after --")


def run(a: argparse.Namespace) -> int:
    """Print the exports or the launcher, or replace this process by the launch of
    ``a.command`` on ``a.n`` ranks."""
    launcher = detect()
    if a.exports:
        lines = [f"export {k}={shlex.quote(v)}" for k, v in launcher.env().items()
                 if k not in RUN_DEFAULTS]
        lines += [f"export {k}=${{{k}:-{v}}}" for k, v in RUN_DEFAULTS.items()]
        print("\n".join(lines))
        return 0
    if a.describe:
        print(launcher.describe())
        return 0
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.n is None or not cmd:
        print("hpctrain launch: give -n N -- COMMAND..., --exports or --describe", file=sys.stderr)
        return 2
    sys.stdout.flush()
    argv_ = command(a.n, *cmd, launcher=launcher, bind=a.bind,
                    oversubscribe=not a.no_oversubscribe)
    env = {**RUN_DEFAULTS, **os.environ, **launcher.env()}
    env.update({k: os.environ[k] for k in RUN_DEFAULTS if k in os.environ})  # the caller's win
    env[LAUNCHED_AT] = repr(time.time())  # the ranks' start-up is measured from here
    os.execvpe(argv_[0], argv_, env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpctrain.job.launch", description=__doc__
                                .split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
