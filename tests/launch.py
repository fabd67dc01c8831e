"""Launching hpctrain as a user does (mpirun + the CLI) and reading what a run leaves.

``train_cli(tmp, n, *overrides)`` runs ``LAUNCHER -n N python -m mpi4py -m hpctrain train``
on the tiny preset (``TINY``: tiny-llama.toml; ``config=TINY_GPT`` for the gpt form) and
returns a :class:`Run` with per-step losses and grad norms from
``metrics.jsonl`` and the final parameters from the final checkpoint (global shapes).
``baseline(*overrides)`` is the same on one rank, cached per session (keyed by overrides).
Ranks are started by the launcher of :mod:`hpctrain.job.launch` (Open MPI ``mpirun``, Hydra
``mpiexec`` for an MPICH-built mpi4py, or ``HPCTRAIN_LAUNCHER``), with its local settings
(root, more ranks than cores) and the run defaults; every process started here has the
checkout first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpctrain.job.launch import command, detect, launch_env, with_checkout, without_job

ROOT = Path(__file__).resolve().parents[1]

PY = str(Path(sys.executable))
# The tests' model: the llama form (every preset's architecture); the layout tests run it.
# TINY_GPT, its gpt twin (model.arch = "gpt"), keeps a smoke set of the same layouts
# (tests/matrix/test_gpt_equivalence.py) and the unit tests.
TINY = str(ROOT / "share/configs/tiny-llama.toml")
TINY_GPT = str(ROOT / "share/configs/tiny.toml")

LAUNCHER = detect()  # for this interpreter's mpi4py
MPI_ENV = launch_env(LAUNCHER)  # + OMP_NUM_THREADS=1, HDF5_USE_FILE_LOCKING=FALSE


def env(**extra) -> dict:
    """The environment of a process a test starts: this one's without the variables of the
    MPI job it may run in (a rank of tests/matrix starts no rank of its own job:
    :func:`hpctrain.job.launch.without_job`), the launcher's settings, the checkout first on
    PYTHONPATH (:func:`hpctrain.job.launch.with_checkout`), then ``extra``."""
    e = with_checkout(without_job(dict(os.environ)))
    e.update(MPI_ENV)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def mpirun(n: int, args: list[str], timeout: float = 300, check: bool = True,
           extra_env: dict | None = None, mpirun_args: tuple = (), launcher: tuple = (),
           keep_going: bool = False):
    """Run ``python -m mpi4py ARGS`` on n ranks; returns the CompletedProcess. ``launcher``
    replaces the launcher's program (e.g. ``scripts/cluster.sh mpirun NAME``: ranks on
    simulated nodes); ``keep_going``: a dead rank does not end the others."""
    how = LAUNCHER.with_program(launcher) if launcher else LAUNCHER
    cmd = command(n, *mpirun_args, PY, "-m", "mpi4py", *args, launcher=how,
                  keep_going=keep_going)
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def python_m(module: str, args: list[str], timeout: float = 120, check: bool = True):
    """``python -m MODULE ARGS`` from the repository root, without mpirun."""
    proc = subprocess.run([PY, "-m", module, *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} {args} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def hpctrain(args: list[str], timeout: float = 120, check: bool = True):
    """The CLI without mpirun (one process, MPI singleton)."""
    return python_m("hpctrain", args, timeout, check)


def benchmarks(args: list[str], timeout: float = 120, check: bool = True):
    """``python -m benchmarks ARGS`` (it launches its own mpiruns)."""
    return python_m("benchmarks", args, timeout, check)


@dataclass
class Run:
    run_dir: Path
    metrics: list[dict]
    params: dict[str, np.ndarray] = field(default_factory=dict)
    stdout: str = ""

    @property
    def losses(self) -> np.ndarray:
        return np.array([m["loss"] for m in self.metrics])

    @property
    def grad_norms(self) -> np.ndarray:
        return np.array([m["grad_norm"] for m in self.metrics])


def read_params(ckpt: Path, prefix: str = "model/") -> dict[str, np.ndarray]:
    import h5py

    out = {}
    with h5py.File(ckpt, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...])
                     if hasattr(obj, "shape") and name.startswith(prefix) else None)
    return out


def read_run(run_dir: Path, stdout: str = "") -> Run:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = Run(run_dir, metrics, stdout=stdout)
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        run.params = read_params(run_dir / "checkpoints" / latest.read_text().strip())
    return run


def train_args(run_dir: Path, *overrides: str, config: str = TINY) -> list[str]:
    """``-m hpctrain train CONFIG --run-dir RUN_DIR --set O ...``, the arguments of
    :func:`mpirun` for a training run."""
    args = ["-m", "hpctrain", "train", config, "--run-dir", str(run_dir)]
    for o in overrides:
        args += ["--set", o]
    return args


def train_cli(run_dir: Path, n: int, *overrides: str, config: str = TINY, timeout=300,
              extra_env: dict | None = None, launcher: tuple = ()) -> Run:
    proc = mpirun(n, train_args(run_dir, *overrides, config=config), timeout=timeout,
                  extra_env=extra_env, launcher=launcher)
    return read_run(Path(run_dir), proc.stdout)


def signal_after_steps(run_dir: Path, n: int, *overrides: str, steps: int = 2,
                       sig=signal.SIGUSR1, extra_env: dict | None = None,
                       timeout: float = 120) -> tuple[int, str]:
    """Train on n ranks outside SLURM and send ``sig`` to mpirun (which forwards it to every
    rank) once ``metrics.jsonl`` holds ``steps`` records; (exit code, stdout + stderr)."""
    cmd = command(n, PY, "-m", "mpi4py", *train_args(run_dir, *overrides), launcher=LAUNCHER)
    e = {k: v for k, v in env(**(extra_env or {})).items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        metrics = Path(run_dir) / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, f"no {steps} steps in {timeout:g} s"
            time.sleep(0.1)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


_BASELINES: dict = {}


def baseline(tmp_root: Path, *overrides: str, config: str = TINY, trainer=None) -> Run:
    """The one-rank run of ``config`` with the same overrides (layout keys excluded),
    cached; ``trainer`` (default :func:`train_cli`) takes train_cli's arguments and trains
    it (tests/inprocess.py passes its in-process one)."""
    trainer = trainer or train_cli
    key = (trainer.__name__, config, *sorted(overrides))
    if key not in _BASELINES:
        d = tmp_root / f"baseline_{len(_BASELINES)}"
        _BASELINES[key] = trainer(d, 1, *overrides, config=config)
    return _BASELINES[key]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def assert_same(run: Run, ref: Run, rel: float = 1e-9, what: str = "") -> None:
    """Same losses, grad norms and final parameters as the reference (invariant 1)."""
    assert len(run.losses) == len(ref.losses), (what, run.losses, ref.losses)
    e = rel_err(run.losses, ref.losses)
    assert e <= rel, f"{what}: losses differ by {e:.3e}: {run.losses} vs {ref.losses}"
    e = rel_err(run.grad_norms, ref.grad_norms)
    assert e <= rel, f"{what}: grad norms differ by {e:.3e}"
    assert ref.params, "the reference run wrote no final checkpoint"
    assert set(run.params) == set(ref.params), (what, set(run.params) ^ set(ref.params))
    for name, value in ref.params.items():
        e = rel_err(run.params[name], value)
        assert e <= rel, f"{what}: parameter {name} differs by {e:.3e}"


def ckpt(run, step):
    return run.run_dir / "checkpoints" / f"step_{step:08d}.h5"


def assert_tail_equal(run, ref, start: int, what: str):
    """``run`` resumed at ``start``: its steps equal the reference's steps start+1.."""
    assert len(run.losses) == len(ref.losses) - start, (what, run.losses)
    for name, a, b in (("losses", run.losses, ref.losses[start:]),
                       ("grad norms", run.grad_norms, ref.grad_norms[start:])):
        e = rel_err(a, b)
        assert e <= 1e-9, f"{what}: {name} differ by {e:.3e}: {a} vs {b}"
    for prefix in ("model/", "optim/"):
        mine, want = read_params(ckpt(run, 6), prefix), read_params(ckpt(ref, 6), prefix)
        assert want and set(mine) == set(want), (what, set(mine) ^ set(want))
        for name, value in want.items():
            e = rel_err(mine[name], value)
            assert e <= 1e-9, f"{what}: {name} differs by {e:.3e}"


def optim_state(run, step: int | None = None) -> dict:
    d = run.run_dir / "checkpoints"
    name = f"step_{step:08d}.h5" if step else (d / "latest").read_text().strip()
    return read_params(d / name, prefix="optim/")


def assert_state_same(run, ref, what: str) -> None:
    mine, want = optim_state(run), optim_state(ref)
    assert want and set(mine) == set(want), (what, set(mine) ^ set(want))
    for name, value in want.items():
        assert rel_err(mine[name], value) <= 1e-9, (what, name)


def assert_about_one_dp(run, ref, dp: int, what: str) -> None:
    """Parameter shards, gradient shards and optimizer state: the one-rank bytes / dp, up
    to the padding of each bucket to a multiple of dp (< dp elements per bucket)."""
    m, r = run.metrics[-1], ref.metrics[-1]
    shards = m["mem_params"] - m["mem_params_gathered"]
    for key, here in (("mem_params", shards), ("mem_grads", m["mem_grads"]),
                      ("mem_optimizer", m["mem_optimizer"])):
        want = r[key] / dp
        assert want <= here <= want * 1.01 + 2048, (what, key, here, want)
    # what is gathered at once is a few blocks, not the model
    assert 0 < m["mem_params_gathered"] < r["mem_params"] / 2, (what, m)


def assert_sharded_and_replicated(run, axis: str = "dp") -> None:
    """The ZeRO collectives ran on the shard groups, the all-reduce on the replica groups,
    nothing on the whole dp group."""
    for m in run.metrics:
        b = m["comm_bytes"]
        assert b.get(f"{axis}-shard", 0) > 0 and b.get(f"{axis}-replica", 0) > 0, b
        assert b.get(axis, 0) == 0, b


def simulated_cluster(prefix: str, nodes: int, slots: int = 2):
    """A ``scripts/cluster.sh`` cluster named ``prefix`` + this process id, for a module
    fixture (``yield from``): its name, removed afterwards; skipped where namespaces cannot
    be made (not root), failed where they should (root with iproute2)."""
    import shutil

    import pytest

    script = str(ROOT / "scripts/cluster.sh")
    check = subprocess.run([script, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        if os.geteuid() == 0 and shutil.which("ip"):
            pytest.fail(f"scripts/cluster.sh check failed as root: {check.stderr.strip()}")
        pytest.skip(f"no simulated cluster here (needs root): {check.stderr.strip()}")
    name = f"{prefix}{os.getpid() % 10**6}"
    subprocess.run([script, "up", name, str(nodes), str(slots)], check=True,
                   capture_output=True)
    try:
        yield name
    finally:
        subprocess.run([script, "down", name], check=True)
