"""Many layouts in one MPI launch: the equivalence matrix of ``tests/matrix``.

Under ``mpirun -n 8 python -m mpi4py -m pytest --with-mpi tests/matrix`` every rank runs every
test. :func:`train_layout` trains a layout on the first n ranks of the launch, calling
``hpctrain.train.train`` on a sub-communicator exactly as ``hpctrain train`` calls it on the
world (the same config loading and validation), while the other ranks wait without spinning;
then every rank reads what the run left (metrics, final checkpoint: :func:`launch.read_run`),
so a test's assertions run alike on every rank and the ranks agree on its outcome
(``tests/agreement.py``). :func:`baseline` is the one-rank run, trained once per launch.
Torch, h5py and hpctrain are imported once per process instead of once per layout.

Run directories must be the same path on every rank: ``tests/matrix/conftest.py`` gives
``tmp_path`` and ``session_dir`` from rank 0 to all.
"""

from __future__ import annotations

import time
from pathlib import Path

import launch
from launch import TINY, Run, read_run
from mpi4py import MPI

_COMM: list = []  # [a duplicate of MPI_COMM_WORLD], made at first use


def world():
    if not _COMM:
        _COMM.append(MPI.COMM_WORLD.Dup())
    return _COMM[0]


def wait_for_all(c) -> None:
    """A barrier that sleeps: idle ranks leave the cores to the ranks that train."""
    req = c.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def same_path(path: Path | None) -> Path:
    """Rank 0's ``path`` on every rank."""
    return Path(world().bcast(None if path is None else str(path)))


def train_layout(run_dir: Path, n: int, *overrides: str, config: str = TINY) -> Run:
    """``hpctrain train CONFIG --run-dir RUN_DIR --set O ...`` on the first n ranks of the
    launch (``train()`` on their sub-communicator); every rank returns the :class:`Run`. A
    failure on any training rank fails the call on every rank."""
    from hpctrain import comm
    from hpctrain.config import load
    from hpctrain.train import train

    c = world()
    assert n <= c.size, f"this layout needs {n} ranks; the matrix runs on 8 (tests/run_all.sh)"
    sub = c.Split(0 if c.rank < n else MPI.UNDEFINED, c.rank)
    error = None
    if sub != MPI.COMM_NULL:
        try:
            train(load(config, list(overrides)), run_dir, comm.Group(sub, "world"))
        except Exception as e:  # noqa: BLE001  (reported on every rank below, then raised)
            error = e
    wait_for_all(c)
    failed = [f"rank {r}: {why}" for r, why in enumerate(c.allgather(
        None if error is None else f"{type(error).__name__}: {error}")) if why]
    if error is not None:
        raise error
    assert not failed, f"{' '.join(overrides)} on {n} ranks failed: {'; '.join(failed)}"
    if sub != MPI.COMM_NULL:
        sub.Free()
    log = Path(run_dir) / "train.log"  # what rank 0 printed, as the CLI's stdout
    return read_run(Path(run_dir), log.read_text() if log.is_file() else "")


def baseline(tmp_root: Path, *overrides: str, config: str = TINY) -> Run:
    """The one-rank run of ``config`` with these overrides, trained once per launch
    (:func:`launch.baseline` with :func:`train_layout`)."""
    return launch.baseline(tmp_root, *overrides, config=config, trainer=train_layout)


def on_root(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on rank 0 alone (a file to write, a one-process command to
    run), its value on every rank. An exception on rank 0 is raised on every rank."""
    c = world()
    value, error = None, None
    if c.rank == 0:
        try:
            value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (sent to every rank, then raised)
            error = e
    value, error = c.bcast((value, error if error is None else repr(error)))
    if error is not None:
        raise AssertionError(f"on rank 0: {error}")
    return value
