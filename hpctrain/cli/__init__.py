"""Subcommands of the ``hpctrain`` CLI, one module each, and how a command on many ranks
refuses its input (:func:`refused`).

Importing it sets what Open MPI reads at ``MPI_Init`` (which a command's first import of
``hpctrain.comm`` runs) where the launch or the site left it unset: libnbc's nonblocking
all-reduce as reduce-scatter + all-gather (``job.launch.LIBNBC_ALLREDUCE``,
docs/decisions.md), so that ``srun hpctrain train`` reduces as ``hpctrain launch`` does.
Other MPI families ignore it."""

from __future__ import annotations

import os
import sys

from ..job.launch import LIBNBC_ALLREDUCE

os.environ.setdefault(*LIBNBC_ALLREDUCE)


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
