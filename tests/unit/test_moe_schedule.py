"""Expert exchanges as schedule actions: the expansion is simulated, overlaps, keeps ep order."""

import pytest

from hpctrain.config import ModelConfig
from hpctrain.pipeline.actions import Action, Schedule
from hpctrain.pipeline.moe_overlap import (
    SEGMENTS,
    check_ep_order,
    expand,
    moe_layers_per_stage,
)
from hpctrain.pipeline.schedules import build
from hpctrain.pipeline.simulate import ScheduleError, simulate


def windows(actions):
    """Per posted exchange (D, C, CB, DB), the compute of other microbatches that runs
    before the action that waits for it (E, G, XB, YB)."""
    waits = {"D": "E", "C": "G", "CB": "XB", "DB": "YB"}
    out, open_w = [], {}
    for a in actions:
        key = (a.microbatch, a.c)
        if a.kind not in waits and a.kind not in ("SF", "RF", "SB", "RB"):  # compute
            for (k, _), inside in open_w.items():
                if k != key:
                    inside.append(str(a))
        if a.kind in waits:
            open_w[(key, waits[a.kind])] = []
        elif (key, a.kind) in open_w:
            out.append(open_w.pop((key, a.kind)))
    assert not open_w
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


def test_pp1_1f1b_forward_and_backward_exchanges_ping_pong():
    sched = expand(build("1f1b", 1, 3), [1])
    assert sched.text(0) == ("F0 D0 E0 C0 G0 B0 CB0 F1 D1 XB0 DB0 E1 C1 YB0 G1 "
                             "B1 CB1 F2 D2 XB1 DB1 E2 C2 YB1 G2 B2 CB2 XB2 DB2 YB2")
    w = windows(sched.ranks[0])
    assert len(w) == 12 and sum(1 for x in w if x) == 8  # all but mb 0's F and mb 2's B
    assert w[2:6] == [["F1"], ["XB0"], ["E1"], ["YB0"]]  # CB0, D1, DB0, C1 hidden


def test_two_forwards_ping_pong_every_dispatch():
    sched = expand(build("gpipe", 1, 2), [2])
    assert sched.text(0).startswith("F0 D0 F1 D1 E0 C0 E1 C1 G0 D0 G1 D1 E0 C0 E1 C1 G0 G1 ")
    assert all(windows(sched.ranks[0]))


def test_split_backward_keeps_blocking_exchanges():
    sched = expand(build("zb-h1", 2, 3), [1, 1])
    kinds = {a.kind for acts in sched.ranks for a in acts}
    assert {"D", "E", "C", "G"} <= kinds and not kinds & {"CB", "XB", "DB", "YB"}


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
    assert out.text(0) == "F0 D0 E0 C0 G0 B0 CB0 XB0 DB0 YB0"
