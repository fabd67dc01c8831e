"""The watchdog is on by default, with a limit a healthy run cannot reach: a fixed floor
(``telemetry.watchdog_s``) and, once steps have been timed, a multiple
(``telemetry.watchdog_factor``) of the slowest step so far, checkpoint and evaluation steps
included; the checkpoint and evaluation phases, whose first occurrence may come before any
slow step was seen, get more. ``watchdog_s = 0`` turns it off, ``watchdog_factor = 0`` pins
the limit to ``watchdog_s`` (the fault tests)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from fakes import OneRank, fake_topology

from hpctrain.comm.records import Recorder
from hpctrain.config import Config, load
from hpctrain.telemetry.metrics import Timers
from hpctrain.telemetry.watchdog import CHECKPOINT_FACTOR, Watchdog, limit_s


def test_default_config_has_the_watchdog_on():
    tc = Config().telemetry
    assert tc.watchdog_s >= 300 and tc.watchdog_factor >= 5
    assert load(None).telemetry.watchdog_s == tc.watchdog_s  # presets keep the default
    for preset in (Path(__file__).resolve().parents[2] / "share/configs").glob("*.toml"):
        assert load(preset).telemetry.watchdog_s > 0, preset
    off = load(None, ["telemetry.watchdog_s=0"]).telemetry
    assert off.watchdog_s == 0  # a user can still turn it off


def test_limit_is_the_floor_until_steps_are_slow():
    assert limit_s(600, 10, 0.0, "compute") == 600  # before the first step ends
    assert limit_s(600, 10, 5.0, "compute") == 600  # 10 x 5 s < floor
    assert limit_s(600, 10, 90.0, "compute") == 900  # slow steps raise it
    assert limit_s(600, 10, 90.0, "grad_sync") == 900
    assert limit_s(8, 0, 90.0, "compute") == 8  # factor 0: pinned (tests)


def test_a_slow_save_or_evaluation_step_raises_the_limit():
    dog = SimpleNamespace(floor=600.0, factor=10.0, slowest=0.0, eval_batches=4)
    for step_s in (1.0, 1.2, 75.0, 1.1):  # step 3 saved a checkpoint for 74 s
        Watchdog.end_step(dog, step_s)
    assert dog.slowest == 75.0
    assert limit_s(dog.floor, dog.factor, dog.slowest, "compute") == 750


def test_checkpoint_and_evaluation_phases_get_more():
    # The first save or evaluation may come before any slow step was seen: the checkpoint
    # phase gets CHECKPOINT_FACTOR x the limit, evaluation one limit per held-out batch
    # (each is a forward pass of one global batch, less than a training step).
    assert limit_s(600, 10, 2.0, "checkpoint") == 600 * CHECKPOINT_FACTOR
    assert limit_s(600, 10, 100.0, "checkpoint") == 1000 * CHECKPOINT_FACTOR
    assert limit_s(600, 10, 2.0, "eval", eval_batches=20) == 600 * 20
    assert limit_s(600, 10, 2.0, "eval", eval_batches=0) == 600


def fake_topo():
    return fake_topology(recorder=Recorder(), coords="(pp=0, dp=0, ep=0, tp=0)",
                         hostname="here")


def test_the_thread_sleeps_and_stops_at_close(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, now, ops, limit: fired.append(now))
    timers = Timers()
    dog = Watchdog(600, fake_topo(), tmp_path, timers, factor=10)
    assert dog._thread.is_alive() and dog.poll == 1.0  # wakes once a second
    dog.begin_step(1)
    with timers("compute"):
        time.sleep(0.05)
    dog.end_step(0.05)
    t0 = time.perf_counter()
    dog.close()
    assert time.perf_counter() - t0 < 1.0 and not dog._thread.is_alive() and not fired
    dog.close()  # idempotent (a run that stops early, then the end of the run)
    assert "hpctrain-watchdog" not in [t.name for t in threading.enumerate()]


def test_a_pinned_small_limit_fires(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, now, ops, limit: fired.append(limit))
    dog = Watchdog(0.3, fake_topo(), tmp_path, Timers(), factor=0)
    dog.begin_step(1)
    dog.end_step(5.0)  # a slow step: pinned (factor 0), the limit stays 0.3 s
    dog.begin_step(2)
    time.sleep(1.0)
    dog.close()
    assert fired == [0.3]


def test_a_hanging_background_write_fires_although_the_steps_go_on(tmp_path, monkeypatch):
    """The steps keep making progress while an asynchronous save's write hangs: the watchdog
    watches the write's age (checkpoint limit) and names it; a write that ends in time does
    not fire it."""
    from hpctrain.checkpoint.background import InFlight
    from hpctrain.telemetry.watchdog import summarise

    fired = []
    monkeypatch.setattr(Watchdog, "_fire",
                        lambda self, now, ops, limit: fired.append((limit, self.stuck)))
    timers = Timers()
    dog = Watchdog(0.05, fake_topo(), tmp_path, timers, factor=0)  # checkpoint: 0.5 s
    release = threading.Event()
    flight = InFlight(SimpleNamespace(write=lambda snap: (release.wait(10), {})[1]), OneRank())
    dog.watch(flight.running)
    dog.begin_step(1)
    flight.start(SimpleNamespace(step=4))  # one that ends in time
    release.set()
    assert flight.poll(block=True)["ckpt_async_step"] == 4 and flight.running() is None
    release.clear()
    flight.start(SimpleNamespace(step=7))  # one that hangs
    t0 = time.perf_counter()
    while not fired and time.perf_counter() - t0 < 5:
        with timers("compute"):  # steps go on: progress all the time
            time.sleep(0.01)
        assert flight.poll(block=False) is None
    release.set()
    dog.close()
    assert flight.poll(block=True)["ckpt_async_step"] == 7
    assert len(fired) == 1, fired
    limit, stuck = fired[0]
    assert limit == 0.05 * CHECKPOINT_FACTOR
    assert stuck.startswith("the background write of checkpoint step 7 has run for 0.")
    assert time.perf_counter() - t0 < 2.0
    rec = {"coords": "(pp=0)", "host": "here", "step": 9, "stuck": stuck, "ops": [],
           "phase": "compute", "idle_s": 0.0}
    assert stuck in summarise({0: rec}, 1, limit)


HOLD_THE_LOCK = """
import ctypes, sys, time
sys.path.insert(0, sys.argv[1])
from test_watchdog_limit import fake_topo
from hpctrain.telemetry.metrics import Timers
from hpctrain.telemetry.watchdog import Watchdog
dog = Watchdog(0.1, fake_topo(), sys.argv[2], Timers(), factor=0)
dog.begin_step(1)
time.sleep(0.5)  # the thread checks (and arms the backstop) at least once
print("holding", flush=True)
ctypes.PyDLL(None).sleep(60)  # a C call that keeps the interpreter lock, as h5py's do
print("returned", flush=True)
"""


def test_a_rank_whose_thread_is_starved_is_ended_by_the_backstop(tmp_path):
    """The main thread blocks in C holding the interpreter lock (an HDF5 collective while a
    peer is stopped): the Python thread cannot run, the C backstop ends the rank after
    1.5 x the checkpoint limit + 5 s (here 6.5 s) with every thread's stack."""
    here = str(Path(__file__).parent)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HOLD_THE_LOCK, here, str(tmp_path)],
                          capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": f"{here}:{here}/.."})
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "holding" in proc.stdout and "returned" not in proc.stdout
    assert "Timeout (0:00:06.500000)!" in proc.stderr, proc.stderr
    assert "most recent call first" in proc.stderr
    assert 6 < took < 40
