"""scripts/mpi-family.sh: which MPI family a program or a parallel HDF5 links (set-up stops
when mpicc and HDF5 differ), from canned ``ldd`` output of each family's library names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def family(ldd_text: str) -> str:
    return subprocess.run(["bash", "-c", "source scripts/mpi-family.sh; mpi_family_of_libs"],
                          input=ldd_text, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("line,want", [
    ("libmpi.so.40 => /lib/x86_64-linux-gnu/libmpi.so.40 (0x1)", "openmpi"),       # Open MPI 3-5
    ("libmpi.so.20 => /opt/openmpi-2/lib/libmpi.so.20 (0x1)", "openmpi"),
    ("libmpich.so.12 => /lib/x86_64-linux-gnu/libmpich.so.12 (0x1)", "mpich"),     # Debian MPICH
    ("libmpi.so.12 => /opt/intel/mpi/lib/release/libmpi.so.12 (0x1)", "mpich"),    # Intel MPI
    ("libmpi_cray.so.12 => /opt/cray/pe/lib64/libmpi_cray.so.12 (0x1)", "mpich"),  # Cray MPICH
    ("libmpi_gnu_123.so.12 => /opt/cray/pe/mpich/lib/libmpi_gnu_123.so.12", "mpich"),
    ("libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x1)", "unknown"),             # static MPI
])
def test_family_of_each_library(line, want):
    assert family(f"\tlinux-vdso.so.1 (0x1)\n\t{line}\n") == want
