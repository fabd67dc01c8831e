"""An exception nothing catches ends the whole job, however the ranks were started.

Python's default ends only the process that raised: its peers wait in their next collective
until the watchdog (or forever), holding every node of the allocation. :func:`abort_on_exception`
replaces ``sys.excepthook`` and ``threading.excepthook`` so that such an exception prints its
traceback with the rank and calls ``MPI_Abort`` on the world (what ``python -m mpi4py`` does
for the main thread, without needing it on the command line).
"""

from __future__ import annotations

import sys
import threading
import traceback

from mpi4py import MPI

from .group import Group


def abort_on_exception(world: Group) -> None:
    """With more than one rank: an uncaught exception in any thread of this process prints
    ``hpctrain: rank R of N: unhandled TYPE ...`` and its traceback (each line prefixed with
    the rank), flushes, and aborts every rank with status 1. With one rank, Python's default
    is kept. Not collective; call it once MPI is initialised (``comm.world()``)."""
    if world.size == 1:
        return
    rank, size = world.rank, world.size

    def fatal(kind, value, tb, where: str) -> None:
        if MPI.Is_finalized():  # after a deliberate exit: nothing left to end
            sys.__excepthook__(kind, value, tb)
            return
        lines = "".join(traceback.format_exception(kind, value, tb)).splitlines()
        text = "\n".join(f"[rank {rank}] {line}" for line in lines)
        try:
            sys.stdout.flush()
            print(f"hpctrain: rank {rank} of {size}: unhandled {kind.__name__}{where}; ending "
                  f"every rank (MPI_Abort)\n{text}", file=sys.stderr, flush=True)
        finally:
            MPI.COMM_WORLD.Abort(1)

    def thread_hook(args) -> None:
        if args.exc_type is SystemExit:  # a thread that ends itself (Python's default too)
            return
        name = args.thread.name if args.thread is not None else "?"
        fatal(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name}")

    sys.excepthook = lambda kind, value, tb: fatal(kind, value, tb, "")
    threading.excepthook = thread_hook
