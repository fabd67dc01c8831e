"""The launcher abstraction (hpctrain/job/launch.py): each family's flags for oversubscription,
binding and environment passing, the family read from ``--version``, the local settings, and
that no other file of the checkout spells a launcher's own flags or variables."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpctrain.job import launch
from hpctrain.job.launch import Launcher

OPENMPI = Launcher("openmpi", ("mpirun",))
HYDRA = Launcher("hydra", ("mpiexec.mpich",))
SRUN = Launcher("srun", ("srun", "--mpi=pmi2"))


def test_flags_per_family():
    assert OPENMPI.argv(4) == ["mpirun", "-n", "4", "--oversubscribe"]
    assert OPENMPI.argv(2, oversubscribe=False, bind="core", export=("A", "B")) == [
        "mpirun", "-n", "2", "--bind-to", "core", "-x", "A", "-x", "B"]
    # Hydra runs any number of local ranks and passes the whole environment by default.
    assert HYDRA.argv(4) == ["mpiexec.mpich", "-n", "4"]
    assert HYDRA.argv(2, bind="none", export=("A", "B")) == [
        "mpiexec.mpich", "-n", "2", "-bind-to", "none", "-genvlist", "A,B"]
    assert SRUN.argv(4, bind="core") == ["srun", "--mpi=pmi2", "-n", "4", "--overcommit",
                                         "--cpu-bind=cores", "--export=ALL"]
    # A dead rank does not end the others (the watchdog must):
    assert OPENMPI.argv(2, keep_going=True)[-1] == "--enable-recovery"
    assert HYDRA.argv(2, keep_going=True)[-1] == "-disable-auto-cleanup"
    assert SRUN.argv(2, keep_going=True)[-1] == "--kill-on-bad-exit=0"


def test_local_settings_only_for_open_mpi():
    assert OPENMPI.env()["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert HYDRA.env() == SRUN.env() == launch.RUN_DEFAULTS
    assert launch.without_job({"OMPI_COMM_WORLD_RANK": "0", "PMI_RANK": "1",
                                "HYDRA_FOO": "x", "PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize("text,program,family", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to", "mpirun", "openmpi"),
    ("prterun (Open MPI) 5.0.3", "mpirun", "openmpi"),
    ("HYDRA build details:\n    Version: 4.0.2", "mpiexec.mpich", "hydra"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build\nHYDRA build details:",
     "mpiexec", "hydra"),
    ("slurm 22.05.8", "/usr/bin/srun", "srun"),
])
def test_family_from_version(text, program, family):
    assert launch.family_of(text, program) == family


def test_unknown_launcher_is_refused_by_name():
    with pytest.raises(RuntimeError, match="HPCTRAIN_LAUNCHER"):
        launch.family_of("aprun version 6", "aprun")
    with pytest.raises(ValueError, match="unknown launcher family"):
        Launcher("aprun", ("aprun",))


def test_environment_override(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_LAUNCHER", "srun --mpi=pmix")
    assert launch.default_program() == ("srun", "--mpi=pmix")
    assert launch.detect() == Launcher("srun", ("srun", "--mpi=pmix"))


def test_exports_for_a_shell():
    out = subprocess.run([sys.executable, "-m", "hpctrain.job.launch", "--exports"],
                         cwd=launch.ROOT, capture_output=True, text=True, check=True).stdout
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in out.splitlines()


@pytest.mark.parametrize("site", [None, "1"])
def test_the_cli_sets_the_nonblocking_allreduce_unless_the_site_did(site):
    """``srun hpctrain train`` (no ``hpctrain launch``) gets libnbc's reduce-scatter +
    all-gather before MPI starts; a value the site or the user set is kept."""
    name, value = launch.LIBNBC_ALLREDUCE
    env = {k: v for k, v in os.environ.items() if k != name} | ({name: site} if site else {})
    code = ("import os, sys; import hpctrain.cli; "
            f"print(os.environ[{name!r}], 'mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=launch.ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [site or value, "False"]


def test_launcher_flags_live_in_one_module():
    """No OMPI_* variable or --oversubscribe in code outside hpctrain/job/launch.py (and this
    test); the docs may describe them."""
    files = subprocess.run(["git", "grep", "-l", "-e", "OMPI_", "-e", "--oversubscribe", "--",
                            ":!*.md"],
                           cwd=launch.ROOT, capture_output=True, text=True).stdout.split()
    assert set(files) <= {"hpctrain/job/launch.py", "tests/unit/test_launcher.py"}, files


def test_program_follows_the_library_mpi4py_links(monkeypatch, tmp_path):
    monkeypatch.delenv("HPCTRAIN_LAUNCHER", raising=False)
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib" / "libmpi.so.12").touch()
    (tmp_path / "bin" / "mpiexec").touch()
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    monkeypatch.setattr(launch, "mpi4py_library", lambda: str(tmp_path / "lib/libmpi.so.12"))
    assert launch.default_program() == (str(tmp_path / "bin" / "mpiexec"),)  # a site prefix
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(launch, "mpi4py_library", lambda: "/lib/libmpich.so.12")
    assert launch.default_program() == ("mpiexec.mpich",)  # Debian, both families installed
    monkeypatch.setattr(launch, "mpi4py_library", lambda: "")  # the binary wheel
    assert launch.default_program() == ("mpirun",)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m hpctrain ARGS`` as a user runs it, from the checkout."""
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=launch.ROOT,
                          env=launch.with_checkout(env if env is not None else dict(os.environ)),
                          capture_output=True, text=True, timeout=120)


def test_the_launch_command_describes_and_starts_a_command():
    """``hpctrain launch --describe`` names the launcher this interpreter finds, and
    ``hpctrain launch -n 1 -- python -c ...`` starts the command through it, with the run
    defaults (OMP_NUM_THREADS=1 unless the caller sets it)."""
    described = _cli("launch", "--describe")
    assert described.returncode == 0, described.stderr
    assert described.stdout.strip() == launch.detect().describe()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import os, sys; print('started', os.environ['OMP_NUM_THREADS'], sys.argv[1:])"
    ran = _cli("launch", "-n", "1", "--", sys.executable, "-c", code, "x", env=env)
    assert ran.returncode == 0, ran.stderr
    assert "started 1 ['x']" in ran.stdout.splitlines()
    refused = _cli("launch", "-n", "1")
    assert refused.returncode == 2 and "give -n N -- COMMAND" in refused.stderr
