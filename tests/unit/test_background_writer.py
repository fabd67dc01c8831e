"""The asynchronous save's writer (checkpoint/background.py): one thread, started with the
``InFlight`` and reused by every save, so that a save's start only queues its snapshot."""

import threading
from types import SimpleNamespace

import pytest
from fakes import OneRank

from hpctrain.checkpoint.background import CheckpointFailed, InFlight


def _flight(write):
    return InFlight(SimpleNamespace(write=write), OneRank())


def test_every_save_runs_on_the_one_writer_thread():
    ran = []
    flight = _flight(lambda snap: (ran.append((snap.step, threading.get_ident())), {})[1])
    threads = threading.active_count()
    for step in (3, 6, 9):
        flight.start(SimpleNamespace(step=step))
        assert flight.busy
        assert flight.poll(block=True).keys() == {"ckpt_background_s", "ckpt_async_step"}
        assert not flight.busy and flight.poll(block=False) == {}
    assert [s for s, _ in ran] == [3, 6, 9]
    assert len({ident for _, ident in ran}) == 1 and ran[0][1] != threading.get_ident()
    assert threading.active_count() == threads  # no thread per save


def test_start_returns_before_the_write_runs():
    release, entered = threading.Event(), threading.Event()
    flight = _flight(lambda snap: (entered.set(), release.wait(10), {})[2])
    flight.start(SimpleNamespace(step=1))
    assert entered.wait(5) and flight.poll(block=False) is None  # still writing
    assert flight.running() is not None
    release.set()
    assert flight.poll(block=True)["ckpt_async_step"] == 1 and flight.running() is None


def test_a_failed_write_is_raised_and_the_next_save_still_runs():
    def write(snap):
        if snap.step == 2:
            raise OSError("disk full")
        return {"ckpt_write_s": 0.1}

    flight = _flight(write)
    flight.start(SimpleNamespace(step=2))
    with pytest.raises(CheckpointFailed, match="step 2 failed on rank 0 .OSError: disk full"):
        flight.poll(block=True)
    assert not flight.busy
    flight.start(SimpleNamespace(step=4))
    got = flight.poll(block=True)
    assert got["ckpt_write_s"] == 0.1 and got["ckpt_async_step"] == 4
