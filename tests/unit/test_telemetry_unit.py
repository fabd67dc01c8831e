"""Pure pieces of telemetry: exclusive timers, the numeric guard, fault specs, the watchdog's
message, the trace window. No MPI."""

import math
import time

import pytest
from fakes import fake_topology

from hpctrain import comm
from hpctrain.config import TelemetryConfig
from hpctrain.faults import ENV, Fault, parse
from hpctrain.optim.numeric_guard import NumericError, NumericGuard
from hpctrain.telemetry.metrics import Timers
from hpctrain.telemetry.trace import parse_window
from hpctrain.telemetry.watchdog import peer_coords, summarise
from hpctrain.topology import Coords


def test_timers_are_exclusive_of_children_and_of_communication():
    recorder = comm.Recorder()
    timers = Timers(recorder=recorder)
    seen = []
    timers.listeners.append(lambda kind, name, t0, t1: seen.append((kind, name)))
    with timers("compute"):
        time.sleep(0.02)
        with timers("inner"):
            time.sleep(0.02)
            assert timers.current == "inner"
        recorder.exposed_s["tp"] += 5.0  # a wait of 5 s recorded inside compute
        timers.add("bubble", 1.0)
        with timers.action("F0"):
            pass
    recorder.take()
    s = timers.take()
    assert timers.current == "-" and timers.take() == {}
    # compute's own time is its wall minus inner, the 5 s wait and the 1 s bubble: negative
    # here because the waits were injected, which proves each was subtracted exactly once.
    assert s["compute"] == pytest.approx(0.02 - 6.0, abs=0.015)
    assert s["inner"] == pytest.approx(0.02, abs=0.015) and s["bubble"] == 1.0
    assert seen == [("phase", "inner"), ("action", "F0"), ("phase", "compute")]


def test_guard_skips_non_finite_and_counts():
    g = NumericGuard(TelemetryConfig(max_skips=3))
    assert g.admit(2.0, 1.0, 1) and g.metrics()["skipped"] is False
    assert not g.admit(math.nan, 1.0, 2)
    assert g.metrics() == {"skipped": True, "skips_total": 1, "rollbacks": 0,
                           "skip_reason": "loss is nan"}
    assert not g.admit(2.0, math.inf, 3) and g.metrics()["skip_reason"] == \
        "gradient norm is inf"
    assert g.admit(2.0, 1.0, 4) and g.consecutive == 0 and g.total == 2


def test_guard_rolls_back_after_k_consecutive_skips():
    calls = []
    g = NumericGuard(TelemetryConfig(max_skips=2, on_skips="rollback"),
                     rollback=lambda: calls.append(1) or "ckpt/step_2.h5")
    assert not g.admit(math.nan, 1.0, 3)
    assert not calls
    assert not g.admit(math.nan, 1.0, 4)
    assert calls == [1] and g.rollbacks == 1 and g.consecutive == 0
    assert "rolled back to ckpt/step_2.h5" in g.metrics()["skip_reason"]


def test_guard_stops_when_asked_or_nothing_to_roll_back_to():
    g = NumericGuard(TelemetryConfig(max_skips=1, on_skips="stop"), rollback=lambda: "x")
    with pytest.raises(NumericError, match="on_skips = \"stop\""):
        g.admit(math.nan, 1.0, 7)
    g = NumericGuard(TelemetryConfig(max_skips=1), rollback=lambda: None)
    with pytest.raises(NumericError, match="step 7: 1 consecutive bad steps .* no checkpoint"):
        g.admit(1.0, math.nan, 7)


def test_guard_loss_spike_threshold():
    g = NumericGuard(TelemetryConfig(loss_spike=2.0, max_skips=0))
    for loss in (3.0, 3.2, 2.8):
        assert g.admit(loss, 1.0, 1)
    assert not g.admit(6.5, 1.0, 4) and "2 x recent mean 3" in g.metrics()["skip_reason"]
    assert g.admit(5.0, 1.0, 5)


def test_fault_specs():
    assert parse("kill@1:3; stall@0:2:60;slow@2:1:0.25") == [
        Fault("kill", 1, 3), Fault("stall", 0, 2, 60.0), Fault("slow", 2, 1, 0.25)]
    assert parse("") == []
    for bad in ("explode@1:2", "kill@1", "kill@x:2"):
        with pytest.raises(ValueError, match="fault"):
            parse(bad)


def test_trace_window():
    assert parse_window("1-3") == (1, 3) and parse_window("4") == (4, 4)
    assert parse_window("all")[0] == 1
    for bad in ("3-1", "a-b", "0-2"):
        with pytest.raises(ValueError, match="trace_steps"):
            parse_window(bad)


def test_peer_coordinates_per_axis():
    topo = fake_topology(ep=2, coords=Coords(1, 2, 1, 0, 0))
    assert peer_coords(topo, "pp", 0) == "(pp=0, dp=2, ep=1, tp=0)"
    assert peer_coords(topo, "tp", 1) == "(pp=1, dp=2, ep=1, tp=1)"
    assert peer_coords(topo, "dp", 3) == "(pp=1, dp=1, ep=1, tp=0)"
    assert peer_coords(topo, "dp", -1) == "all of dp"


def test_watchdog_message_names_the_stuck_and_the_missing():
    def rec(rank, phase, ops):
        return {"rank": rank, "coords": f"(c{rank})", "host": "n0", "step": 4,
                "phase": phase, "step_age_s": 12.0, "idle_s": 11.0, "ops": ops}
    waiting = [{"op": "iallreduce", "axis": "dp", "peer_coords": "all of dp", "bytes": 64,
                "state": "in-flight", "age_s": 11.5}]
    msg = summarise({0: rec(0, "grad_sync", waiting), 1: rec(1, "compute", [])}, 3, 10.0)
    head = msg.splitlines()[0]
    assert "rank 1 (c1) on n0: step 4, in 'compute' without progress for 11.0 s" in head
    assert "rank 2: no flight record" in head
    assert "rank 0 (c0) on n0: step 4, waiting in iallreduce on dp" in msg


def test_faults_come_from_config_and_environment(monkeypatch):
    from hpctrain.telemetry.fault_injection import Faults

    monkeypatch.setenv(ENV, "stall@1:2:5;kill@0:4")
    f = Faults("poison@1:3", world_rank=1)
    assert f.mine == [Fault("poison", 1, 3), Fault("stall", 1, 2, 5.0)]
    monkeypatch.delenv(ENV)
    assert not Faults("", world_rank=0)


def test_timers_synchronise_the_device_around_categories_only():
    calls = []
    timers = Timers(sync=lambda: calls.append(timers.current))
    with timers("compute"):
        with timers.action("F0"):
            pass
    assert calls == ["-", "compute"]  # before entering, before leaving; none for actions
