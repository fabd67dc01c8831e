"""``comm.abort_on_exception``: with several ranks an uncaught exception, in the main thread
or another, prints the rank and its traceback and aborts the world; one rank keeps Python's
default (the job with a raising rank: tests/e2e/test_faults.py)."""

import sys
import threading
from types import SimpleNamespace

import pytest

from hpctrain.comm import fatal


class _Stop(Exception):
    """What the stand-in MPI_Abort raises, so the test goes on."""


@pytest.fixture
def hooks(monkeypatch):
    aborted = []

    def abort(code):
        aborted.append(code)
        raise _Stop

    monkeypatch.setattr(fatal, "MPI", SimpleNamespace(
        Is_finalized=lambda: False, COMM_WORLD=SimpleNamespace(Abort=abort)))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    return aborted


def test_one_rank_keeps_pythons_default(hooks):
    before = sys.excepthook, threading.excepthook
    fatal.abort_on_exception(SimpleNamespace(size=1, rank=0))
    assert (sys.excepthook, threading.excepthook) == before


def test_several_ranks_print_the_rank_and_abort(hooks, capsys):
    fatal.abort_on_exception(SimpleNamespace(size=4, rank=3))
    try:
        raise ValueError("broken on this rank")
    except ValueError as e:
        with pytest.raises(_Stop):
            sys.excepthook(type(e), e, e.__traceback__)
    err = capsys.readouterr().err
    assert "hpctrain: rank 3 of 4: unhandled ValueError; ending every rank" in err
    assert "[rank 3] ValueError: broken on this rank" in err
    assert hooks == [1]


def test_a_thread_that_dies_aborts_and_one_that_exits_does_not(hooks, capsys):
    fatal.abort_on_exception(SimpleNamespace(size=2, rank=1))
    t = threading.Thread(name="worker")
    with pytest.raises(_Stop):
        threading.excepthook(SimpleNamespace(exc_type=OSError, exc_value=OSError("disk"),
                                             exc_traceback=None, thread=t))
    assert "unhandled OSError in thread worker" in capsys.readouterr().err
    threading.excepthook(SimpleNamespace(exc_type=SystemExit, exc_value=SystemExit(0),
                                         exc_traceback=None, thread=t))
    assert hooks == [1]
