"""``hpctrain prepare`` with one rank's I/O failing (run under mpirun by
tests/e2e/test_data_cli.py).

``python -m mpi4py tests/e2e/prepare_fault.py RANK WHERE PREPARE_ARGS...``: on world rank
RANK, ``WHERE = write`` makes every write into an HDF5 dataset raise ``OSError(ENOSPC)`` (a
full disk, seen by that rank only); ``WHERE = read`` makes reading a source document raise
``RuntimeError`` (an unexpected error before the first collective). Then runs the command as
``python -m hpctrain prepare PREPARE_ARGS...`` would and exits with its status.
"""

from __future__ import annotations

import errno
import os
import sys

from mpi4py import MPI


def _full_disk(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _unexpected(*_args, **_kwargs):
    raise RuntimeError("injected failure reading a document")


def main() -> int:
    rank, where, *args = sys.argv[1:]
    if MPI.COMM_WORLD.rank == int(rank):
        if where == "write":
            import h5py

            h5py.Dataset.__setitem__ = _full_disk
        else:
            from pathlib import Path

            Path.read_bytes = _unexpected
    from hpctrain.__main__ import main as hpctrain

    return hpctrain(["prepare", *args])


if __name__ == "__main__":
    sys.exit(main())
