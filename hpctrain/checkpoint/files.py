"""Opening checkpoint files: h5py over MPI-IO (the ``mpio`` driver, parallel HDF5) or alone.

An :class:`Opener` belongs to one communicator (the training world, or the background
writer's duplicate) and builds its HDF5 file-access property list once: the ``mpio`` driver's
``H5Pset_fapl_mpio`` duplicates the communicator and the hints (a collective call), which
h5py's ``File(..., driver="mpio")`` would do again at every open; the alignment
(``checkpoint.alignment``: objects of at least ``align_min_bytes`` start at a multiple of
it, e.g. the Lustre stripe) is set there too.

:meth:`Opener.applied_hints` asks MPI which MPI-IO hints it applies to a file in the
checkpoint directory (``comm.applied_hints``: ``MPI_File_get_info``), once per opener; the
writer stores them in each file's ``mpi_hints_applied`` attribute next to the requested
ones, and ``hpctrain inspect`` prints both. ROMIO (MPICH, Cray MPICH, Intel MPI) reports
every hint in effect, its defaults and the striping included; Open MPI's OMPIO echoes the
keys it was given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import comm

PROBE = ".mpi-hints-probe"


class Opener:
    """``opener(path, mode)`` -> an open ``h5py.File`` (mode "r", "r+" or "w"); over
    ``group`` with MPI-IO when ``mpio`` (then collective), alone otherwise."""

    def __init__(self, group, mpio: bool, hints: dict, alignment: int, align_min_bytes: int):
        self.group, self.mpio, self.hints = group, mpio, dict(hints)
        self.alignment, self.align_min_bytes = alignment, align_min_bytes
        self._fapl = None
        self._applied: str | None = None

    def fapl(self):
        """The file-access property list, built at the first open (collective with mpio)."""
        if self._fapl is None:
            from h5py import h5f, h5p

            fapl = h5p.create(h5p.FILE_ACCESS)
            fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default
            if self.alignment > 0:
                fapl.set_alignment(self.align_min_bytes, self.alignment)
            if self.mpio:
                fapl.set_fapl_mpio(self.group.mpi, comm.mpi_info(self.hints))
            self._fapl = fapl
        return self._fapl

    def __call__(self, path, mode: str):
        import h5py
        from h5py import h5f

        name = os.fsencode(str(path))
        if mode == "w":
            fid = h5f.create(name, h5f.ACC_TRUNC, fapl=self.fapl())
        else:
            fid = h5f.open(name, h5f.ACC_RDONLY if mode == "r" else h5f.ACC_RDWR,
                           fapl=self.fapl())
        return h5py.File(fid)

    def applied_hints(self, directory: Path) -> str:
        """The hints MPI applies to a file in ``directory``, as JSON ("{}" without MPI-IO);
        probed at the first call by opening and removing ``PROBE``. Collective."""
        if self._applied is None:
            if not self.mpio:
                self._applied = "{}"
            else:
                probe = Path(directory) / PROBE
                got = comm.applied_hints(self.group, probe, comm.mpi_info(self.hints))
                self.group.barrier()
                if self.group.rank == 0:
                    probe.unlink(missing_ok=True)
                self._applied = json.dumps(got, sort_keys=True)
        return self._applied
