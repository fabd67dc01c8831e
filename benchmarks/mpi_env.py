"""The local Open MPI environment (root, oversubscription, yield when idle), read from its one
source ``scripts/mpi-env.sh`` (also sourced by bash and included by the Makefile), plus the
defaults every local launch sets. Used by ``tests/launch.py`` and by the benchmark drivers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ is not installed
MPI_ENV_FILE = ROOT / "scripts" / "mpi-env.sh"
# Not Open MPI settings but defaults of every local launch (the Makefile sets them with ?=).
RUN_DEFAULTS = {"OMP_NUM_THREADS": "1", "HDF5_USE_FILE_LOCKING": "FALSE"}
# A value bash and make read alike: no quotes, `$`, backslashes or spaces.
_EXPORT = re.compile(r"export ([A-Za-z_][A-Za-z0-9_]*)=([^\s'\"$\\]*)")


def read(path: str | Path = MPI_ENV_FILE) -> dict[str, str]:
    """NAME -> value of each ``export NAME=value`` line of ``path``; blank lines and ``#``
    comments are skipped, any other line is an error (the file must stay valid for both
    ``source`` and make's ``include``)."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _EXPORT.fullmatch(line)
        if m is None:
            raise ValueError(f"{path}:{n}: not of the form `export NAME=value`: {line!r}")
        out[m[1]] = m[2]
    return out


def launch_env() -> dict[str, str]:
    """What a local ``mpirun`` needs on top of the caller's environment: the Open MPI
    settings of ``scripts/mpi-env.sh`` and :data:`RUN_DEFAULTS`."""
    return {**read(), **RUN_DEFAULTS}


def with_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the checkout first on PYTHONPATH, so that processes started anywhere
    (mpirun's ranks) import ``benchmarks``."""
    path = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
