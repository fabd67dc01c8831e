"""Subcommands of the ``hpctrain`` CLI, one module each, and how a command on many ranks
refuses its input (:func:`refused`)."""

from __future__ import annotations

import os
import sys


def refused(world, command: str, why) -> int:
    """A verdict every rank reached alike: rank 0 says it, every rank ends with status 2.
    With more than one rank, MPI is finalised and the process exits here: returning 2 under
    ``python -m mpi4py`` would ``MPI_Abort`` each rank, and an abort from a rank that had
    nothing to say can end the job before rank 0's message is out."""
    if world.rank == 0:
        print(f"hpctrain {command}: {why}", file=sys.stderr, flush=True)
    if world.size == 1:
        return 2  # one process (also in-process callers): the caller exits
    sys.stdout.flush()
    from .. import comm

    comm.finalize()  # collective: every rank is here, no collective was left half done
    os._exit(2)
