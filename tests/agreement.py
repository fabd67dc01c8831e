"""Every rank agrees on each test's outcome (tests/mpi and tests/matrix run one pytest per rank,
under mpirun; their conftest.py files import the hook from here).

Without this, an assertion that fails on one rank is caught by that rank's pytest, which
goes on (or stops, under ``-x``) while the other ranks report a pass and wait in the next
test's collectives for a rank that is elsewhere: a hang until the 600 s timeout, and one
rank's failure lost in the others' output. Here, after each phase of each test (setup, call,
teardown) the ranks exchange their outcome on a private duplicate of ``MPI_COMM_WORLD``:

* a failure anywhere fails the phase on every rank, the others with a message naming the
  failing rank(s) and their error; a failed setup therefore skips the body everywhere;
* a skip on some ranks while the rest passed skips the phase everywhere (the test did not
  run whole), naming the ranks that skipped and why;
* every rank counts the same failures, so ``-x`` / ``--maxfail`` stop all ranks together.

The limit: a rank that fails (or skips) *between* two collectives of a test leaves the others
inside a collective it will never join, and no test outcome can rescue them. The failing rank
then waits at most ``HPCTRAIN_TEST_ALONE_S`` seconds (default 60) for the others, prints its
report and aborts the whole job (``MPI_Abort``): the run ends in seconds with the failure
shown, instead of hanging until the timeout. A rank that *hangs* rather than fails (it waits
in a collective the others skipped) is only ended by pytest-timeout. Collection must be the
same on every rank (it is: the same files, parametrised alike).

The agreement uses mpi4py directly: it is test machinery, not trainer code (the rule that all
MPI goes through ``hpctrain/comm/`` is about the package).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

PASSED, SKIPPED, FAILED = 0, 1, 2
ALONE_S = float(os.environ.get("HPCTRAIN_TEST_ALONE_S", "60"))
_COMM = []  # [the duplicate of MPI_COMM_WORLD], made at the first agreement


def _comm():
    if not _COMM:
        from mpi4py import MPI

        _COMM.append(MPI.COMM_WORLD.Dup() if MPI.COMM_WORLD.Get_size() > 1 else None)
    return _COMM[0]


def _status(report) -> int:
    return FAILED if report.failed else SKIPPED if report.skipped else PASSED


def _why(report) -> str:
    """One line: the error message or the skip reason."""
    lr = report.longrepr
    if isinstance(lr, tuple):  # a skip: (path, line, "Skipped: reason")
        text = str(lr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(lr, "reprcrash", None)
        text = crash.message if crash is not None else str(lr or "").strip()
    lines = text.strip().splitlines()
    return (lines[0] if lines else "?")[:300]


def _exchange(comm, mine: int, report) -> list[int]:
    """Everyone's status. A rank that did not pass waits at most ALONE_S for the others:
    if they do not come, they are stuck in a collective this rank left, so it aborts."""
    send = np.array([mine], dtype=np.int32)
    recv = np.empty(comm.Get_size(), dtype=np.int32)
    req = comm.Iallgather(send, recv)
    if mine == PASSED:
        req.Wait()
        return recv.tolist()
    deadline = time.monotonic() + ALONE_S
    while not req.Test():
        if time.monotonic() > deadline:
            _abort(comm, report)
        time.sleep(0.005)
    return recv.tolist()


def _abort(comm, report) -> None:
    from mpi4py import MPI

    rank = comm.Get_rank()
    word = "failed" if report.failed else "skipped"
    print(f"\n{report.nodeid} ({report.when}) {word} on rank {rank}:\n"
          f"{report.longreprtext}\n\nrank {rank}: the other ranks did not finish this test "
          f"within {ALONE_S:g} s (HPCTRAIN_TEST_ALONE_S); they are waiting in a collective this "
          "rank left. Aborting the job.", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)


def agree(report, location) -> None:
    """Make ``report`` (this rank's) the outcome all ranks agree on. Collective."""
    comm = _comm()
    if comm is None:
        return
    mine = _status(report)
    everyone = _exchange(comm, mine, report)
    worst = max(everyone)
    if min(everyone) == worst:
        return
    ranks = [r for r, s in enumerate(everyone) if s == worst]
    notes = comm.allgather(_why(report) if mine == worst else None)
    reason = "; ".join(f"rank {r}: {notes[r]}" for r in ranks)
    if mine == worst:
        return
    where = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
    if worst == FAILED:
        report.outcome = "failed"
        word = "passed" if mine == PASSED else "skipped"
        report.longrepr = (f"{report.when} failed on {where} of {comm.Get_size()} ({word} on "
                           f"rank {comm.Get_rank()}): {reason}")
    else:
        report.outcome = "skipped"
        report.longrepr = (str(location[0]), (location[1] or 0) + 1,
                           f"Skipped: skipped on {where}: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    agree(report, item.location)
    return report
