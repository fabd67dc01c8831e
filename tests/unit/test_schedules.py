"""Schedules as data, checked by the simulator (no MPI)."""

from pathlib import Path

import pytest

from hpctrain.pipeline.actions import Action, Schedule, parse
from hpctrain.pipeline.runner import HANDLERS
from hpctrain.pipeline.schedules import KINDS, build
from hpctrain.pipeline.simulate import ScheduleError, simulate

CASES = [(k, pp, v, m)
         for k in KINDS for pp in (2, 4) for v in (1, 2) for m in (pp, 2 * pp, 2 * pp + 1)
         if ((v == 2) == (k in ("zbv", "dualpipev")) or (k == "interleaved" and v == 1))
         and (k != "dualpipev" or m >= 2 * pp)]  # dualpipev: test_dualpipev.py
CASES += [("zbv", pp, 2, m) for pp in (1, 3) for m in (1, 2, 5)]


def _positions(actions):
    return {(a.kind, a.microbatch, a.c): i for i, a in enumerate(actions)}


@pytest.mark.parametrize("kind,pp,v,m", CASES, ids=[f"{c[0]}-pp{c[1]}-v{c[2]}-m{c[3]}"
                                                     for c in CASES])
def test_schedule_is_sound(kind, pp, v, m):
    if kind == "interleaved" and v > 1 and m % pp:
        with pytest.raises(ValueError, match=f"multiple of {pp}"):
            build(kind, pp, m, v)
        return
    sched = build(kind, pp, m, v)
    result = simulate(sched)  # raises on unmatched transfers, misordering, deadlock
    assert len(sched.ranks) == pp and result.makespan > 0
    split = kind in ("zb-h1", "zbv")
    for r, actions in enumerate(sched.ranks):
        pos = _positions(actions)
        for mb in range(m):
            for c in range(v):
                assert pos[("F", mb, c)] < pos[("B", mb, c)]
                if split:
                    assert pos[("B", mb, c)] < pos[("W", mb, c)]
                stage = sched.stage(r, Action("F", mb, c))
                if stage > 0:  # received before used, sent back after the backward
                    assert pos[("RF", mb, c)] < pos[("F", mb, c)] < pos[("B", mb, c)]
                    assert pos[("B", mb, c)] < pos[("SB", mb, c)]
                if stage < pp * v - 1:
                    assert pos[("F", mb, c)] < pos[("SF", mb, c)]
                    assert pos[("RB", mb, c)] < pos[("B", mb, c)]
        assert all(a.kind in HANDLERS for a in actions)  # the runner can execute it
    # sends and receives pair up one to one
    n_send = sum(a.kind in ("SF", "SB") for acts in sched.ranks for a in acts)
    n_recv = sum(a.kind in ("RF", "RB") for acts in sched.ranks for a in acts)
    assert n_send == n_recv == 2 * m * (pp * v - 1)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
def test_1f1b_bubble_formula_and_memory(pp, m):
    res = simulate(build("1f1b", pp, m))
    assert res.bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    assert res.peak_inflight == [min(pp - r, m) for r in range(pp)]  # 1F1B: at most pp - r
    assert simulate(build("gpipe", pp, m)).peak_inflight == [m] * pp  # GPipe: all of them


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 12])
def test_interleaved_and_zero_bubble_beat_1f1b(pp, m):
    base = simulate(build("1f1b", pp, m)).bubble
    assert simulate(build("interleaved", pp, m, 2)).bubble < base
    assert simulate(build("zb-h1", pp, m)).bubble < base
    zbv, zb = simulate(build("zbv", pp, m)).bubble, simulate(build("zb-h1", pp, m)).bubble
    assert zbv < zb if m >= 2 * pp - 1 else zbv <= zb  # zbv's steady state needs 2pp-1
    # zb-h1 and zbv keep 1F1B's peak activation memory (rank 0's pp microbatches)
    peak = max(simulate(build("1f1b", pp, m)).peak_microbatches)
    for kind in ("zb-h1", "zbv"):
        assert max(simulate(build(kind, pp, m)).peak_microbatches) == peak == pp


# (pp, m) with m >= pp: the closed forms of Qi et al. 2023 hold there (m < pp: too few
# microbatches to fill the pipeline; the simulator still times them).
CLOSED = [(pp, m) for pp in (2, 3, 4, 5, 8) for m in (pp, pp + 1, 2 * pp, 3 * pp + 1)]


@pytest.mark.parametrize("pp,m", CLOSED)
def test_1f1b_and_zb_h1_closed_forms(pp, m):
    """Makespan m(F+B+W) + (p-1)(F+B+W) for 1F1B, + (p-1)(F+B-W) for ZB-H1 (the paper's
    Table 2: one third of 1F1B's bubble at F=B=W), for unit costs and others with W <= F;
    the bubble in each convention of SimResult."""
    one = simulate(build("1f1b", pp, m))
    assert one.makespan == 3 * m + 3 * (pp - 1) and one.bubble_time == 3 * (pp - 1)
    assert one.bubble_rate == pytest.approx((pp - 1) / m, rel=1e-12)
    zb = simulate(build("zb-h1", pp, m))
    assert zb.makespan == 3 * m + (pp - 1) and zb.bubble_time == pp - 1
    assert zb.bubble_rate == pytest.approx((pp - 1) / (3 * m), rel=1e-12)
    assert zb.peak_inflight == [pp] * pp  # every rank holds what 1F1B holds on rank 0
    for F, B, W in ((1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.5, 0.5)):
        res = simulate(build("zb-h1", pp, m), costs={"F": F, "B": B, "W": W})
        assert res.makespan == pytest.approx(m * (F + B + W) + (pp - 1) * (F + B - W))


@pytest.mark.parametrize("pp,m", CLOSED)
def test_zbv_zero_bubble_and_1f1b_memory(pp, m):
    """ZB-V: no idle time inside any rank's span at F=B=W (the published zero bubble), the
    step is the ideal time plus only the pipeline fill (p-1) F/2, and every rank's peak is
    pp microbatches of whole-stage activations, 1F1B's."""
    if m < 2 * pp - 1:  # the steady state needs 2pp-1 microbatches
        m = 2 * pp - 1 + m % 3
    res = simulate(build("zbv", pp, m))
    assert res.span_bubble == 0.0
    assert res.makespan == pytest.approx(3 * m + (pp - 1) / 2)
    assert res.peak_microbatches == [pp] * pp
    assert res.peak_inflight == [2 * pp] * pp  # chunk-microbatches: half a stage each
    sched = build("zbv", pp, m)
    assert sched.stage(0, Action("F", 0, 1)) == 2 * pp - 1  # rank 0: first and last stage
    assert sched.stage(pp - 1, Action("F", 0, 0)) == pp - 1
    assert sched.stage(pp - 1, Action("F", 0, 1)) == pp  # the two middle stages


def test_unequal_costs_change_the_makespan():
    sched = build("1f1b", 2, 4)
    slow_last = simulate(sched, costs=lambda r, a: 2.0 if r == 1 and a.kind == "F" else 1.0)
    assert slow_last.makespan > simulate(sched, costs={"F": 1, "B": 0.5, "W": 0.5}).makespan


def _from_text(kind, pp, m, lists) -> Schedule:
    return Schedule(kind, pp, 1, m, tuple(tuple(parse(t) for t in s.split()) for s in lists))


def test_mismatched_order_is_caught_naming_rank_and_action():
    good = build("gpipe", 2, 2)
    assert good.text(0) == "F0 SF0 RB0 F1 SF1 RB1 B0 B1"  # receives posted one compute ahead
    assert good.text(1).startswith("RF0 RF1 F0")
    # rank 1 posts its receives in the wrong order: its RF1 meets rank 0's SF0.
    bad = [good.text(0), good.text(1).replace("RF0 RF1", "RF1 RF0")]
    sched = _from_text("gpipe", 2, 2, bad)
    with pytest.raises(ScheduleError, match=r"rank 1 action #0 RF1 is met by rank 0 action #1 "
                                            r"SF0: .* same microbatch order"):
        simulate(sched)


def test_deadlock_is_caught_naming_ranks():
    # rank 0 waits for the gradient of microbatch 0 before sending its activation.
    sched = _from_text("1f1b", 2, 1, ["F0 RB0 B0 SF0", "RF0 F0 B0 SB0"])
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 action #2 B0 waits for SB0 "
                                            r".*rank 1 action #1 F0 waits for SF0"):
        simulate(sched)


def test_missing_and_misordered_actions_are_caught():
    with pytest.raises(ScheduleError, match=r"rank 1 action #1 B0: comes before F0"):
        simulate(_from_text("1f1b", 2, 1, ["F0 SF0 RB0 B0", "RF0 B0 F0 SB0"]))
    with pytest.raises(ScheduleError, match=r"rank 0: B0 is missing"):
        simulate(_from_text("1f1b", 2, 1, ["F0 SF0 RB0", "RF0 F0 B0 SB0"]))
    with pytest.raises(ScheduleError, match=r"rank 1 action #0 F0: its input is never received"):
        simulate(_from_text("1f1b", 2, 1, ["F0 SF0 RB0 B0", "F0 B0 SB0"]))


def test_action_strings_round_trip_and_bad_input():
    for text in ("F3", "B0", "W12", "SF3", "RB2v1", "F0v0"):
        assert str(parse(text)) == text
    assert parse("SF3v1") == Action("SF", 3, 1)
    with pytest.raises(ValueError, match="not an action"):
        parse("3F")
    with pytest.raises(ValueError, match="needs schedule.kind='interleaved'"):
        build("1f1b", 2, 4, virtual=2)
    with pytest.raises(ValueError, match="valid: 1f1b, gpipe, zb-h1, zbv, dualpipev, interl"):
        build("pipedream", 2, 4)


def test_plan_command_prints_schedule_bubble_and_inflight(capsys):
    from hpctrain.__main__ import main

    tiny = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")
    args = ["plan", tiny, "--world-size", "4", "--set", "topology.pp=4",
            "--set", "train.global_batch_size=8", "--set", 'schedule.boundaries="1,4,6"']
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pp rank 0: stage(s) [0], layers 0-0 + embedding" in out
    assert "pp rank 3: stage(s) [3], layers 6-7 + head, loss" in out
    assert "peak in-flight microbatches 4" in out and "peak in-flight microbatches 1" in out
    assert "bubble fraction 0.2727" in out  # 1F1B, p=4, m=8: 3/11
    assert out.index("memory per rank") < out.index("schedule 1f1b")  # the verdict first
    assert build("1f1b", 4, 8).text(3) not in out.replace("\n    ", " ")  # on request:
    assert main([*args, "--schedules"]) == 0
    assert build("1f1b", 4, 8).text(3) in capsys.readouterr().out.replace("\n    ", " ")
    bad = ["plan", tiny, "--world-size", "2", "--set", "topology.pp=2", "--set",
           'schedule.kind="interleaved"', "--set", "schedule.virtual_stages=2",
           "--set", "train.global_batch_size=5"]
    assert main(bad) == 2
    assert "use a multiple of 2" in capsys.readouterr().err


def _one_at_a_time(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """The recipe's example (docs/design.md, "A pipeline schedule"): each microbatch's
    forward and backward before the next one's, on every rank."""
    return [Action(kind, mb) for mb in range(m) for kind in ("F", "B")]


def test_a_schedule_is_one_registry_line(monkeypatch):
    """A kind added with one registry entry (and its order function) is accepted by the
    checks, built with its transfers, simulated, priced by the planner and estimated."""
    from hpctrain.checks.validate import validate
    from hpctrain.config import load
    from hpctrain.pipeline import schedules
    from hpctrain.planner.cluster import load as load_cluster
    from hpctrain.planner.cost import predict
    from hpctrain.planner.memory import estimate

    monkeypatch.setitem(schedules.REGISTRY, "one-at-a-time", schedules.Kind(
        "one-at-a-time", _one_at_a_time, in_flight=lambda pp, m: 1))
    sched = build("one-at-a-time", 2, 4)
    assert sched.text(0) == "RB0 F0 SF0 B0 RB1 F1 SF1 B1 RB2 F2 SF2 B2 RB3 F3 SF3 B3"
    assert simulate(sched).bubble > simulate(build("1f1b", 2, 4)).bubble  # no overlap at all
    from launch import TINY

    sets = ["topology.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2"]
    cfg = load(TINY, [*sets, 'schedule.kind="one-at-a-time"'])
    validate(cfg, 2)  # the registry's name is a valid schedule.kind
    ref = load(TINY, [*sets, 'schedule.kind="1f1b"'])
    assert estimate(cfg).activations < estimate(ref).activations  # 1 in flight, not 2
    cluster = load_cluster("cpu-epyc-7763")
    assert predict(cfg, cluster).step_s > predict(ref, cluster).step_s
