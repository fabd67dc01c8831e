"""Expert exchanges as schedule actions: the expansion is simulated, overlaps, keeps ep order."""

import pytest

from hpctrain.config import ModelConfig
from hpctrain.schedule.actions import COMPUTE, Action, Schedule, build
from hpctrain.schedule.experts import (
    SEGMENTS,
    check_ep_order,
    expand,
    moe_layers_per_stage,
)
from hpctrain.schedule.simulate import ScheduleError, simulate


def windows(actions):
    """Per dispatch, the compute of other microbatches run between its D and its E."""
    out, open_d = [], {}
    for a in actions:
        key = (a.microbatch, a.c)
        if a.kind in COMPUTE or a.kind in ("E", "G"):  # compute, incl. expert segments
            for k, inside in open_d.items():
                if k != key:
                    inside.append(a)
        if a.kind == "D":
            open_d[key] = []
        elif a.kind == "E":
            out.append(open_d.pop(key))
    return out


@pytest.mark.parametrize("kind,pp,m,v", [("1f1b", 1, 4, 1), ("gpipe", 1, 4, 1),
                                         ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                         ("zb-h1", 2, 4, 1), ("interleaved", 2, 4, 2)])
def test_expansion_is_accepted_by_the_simulator_and_overlaps(kind, pp, m, v):
    cfg = ModelConfig(n_layers=8, num_experts=4, moe_every=2)
    per_stage = moe_layers_per_stage(cfg, pp * v)
    assert sum(per_stage) == 4
    sched = expand(build(kind, pp, m, v), per_stage)
    simulate(sched)
    for r, actions in enumerate(sched.ranks):
        for mb in range(m):
            for c in range(v):
                segs = [a.kind for a in actions if a.kind in SEGMENTS
                        and (a.microbatch, a.c) == (mb, c)]
                n = per_stage[r + c * pp]
                assert segs == list(SEGMENTS) * n, (r, mb, c, segs)
    overlapped = [w for acts in sched.ranks for w in windows(acts) if w]
    assert overlapped, sched.text(0)  # some dispatch travels during another's compute


def test_pp1_1f1b_hides_each_dispatch_behind_the_previous_backward():
    sched = expand(build("1f1b", 1, 3), [2])
    assert sched.text(0).startswith("F0 D0 E0 C0 G0 D0 E0 C0 G0 F1 D1 B0 E1")
    assert [str(a) for w in windows(sched.ranks[0]) for a in w] == ["B0", "B1"]


def test_two_forwards_ping_pong_every_dispatch():
    sched = expand(build("gpipe", 1, 2), [2])
    assert sched.text(0) == ("F0 D0 F1 D1 E0 C0 E1 C1 G0 D0 G1 D1 E0 C0 E1 C1 G0 G1 B0 B1")
    assert all(windows(sched.ranks[0])) and len(windows(sched.ranks[0])) == 4


def test_ep_order_mismatch_is_rejected():
    acts = expand(build("1f1b", 1, 3), [1]).ranks[0]
    check_ep_order({0: acts, 1: acts})
    swapped = list(acts)
    i = next(k for k, a in enumerate(swapped) if str(a) == "D1")
    j = next(k for k, a in enumerate(swapped) if str(a) == "B0")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="ep_comm order mismatch.*rank 1"):
        check_ep_order({0: acts, 1: swapped})
    with pytest.raises(ScheduleError, match="posts"):
        check_ep_order({0: acts, 1: acts[:-1]})


def test_forward_followed_by_its_own_backward_runs_eagerly():
    base = Schedule("1f1b", 1, 1, 1, ((Action("F", 0), Action("B", 0)),))
    out = expand(base, [1])
    assert out.text(0) == "F0 D0 E0 C0 G0 B0"
