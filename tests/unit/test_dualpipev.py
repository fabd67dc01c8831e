"""DualPipeV (``schedule.kind = "dualpipev"``) as data, checked without MPI: the builder over
several pp and microbatch counts, the bubble and the memory columns of the DualPipe table from
the simulator, the refusal, the expert-exchange expansion of its F&B pairs, and the runner on
its mix of whole and split backwards against one plain backward."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checks.validate import validate
from hpctrain.config import ConfigError, ModelConfig, load
from hpctrain.model import weight_grad
from hpctrain.pipeline.actions import Action, deferred, fb_pairs
from hpctrain.pipeline.moe_overlap import BACK_SEGMENTS, SEGMENTS, expand, moe_layers_per_stage
from hpctrain.pipeline.runner import run_step
from hpctrain.pipeline.schedules import build
from hpctrain.pipeline.simulate import pair_costs, paired, simulate
from hpctrain.planner import cluster, memory, search
from hpctrain.planner.cost import predict

TINY = "share/configs/tiny.toml"
KIND = 'schedule.kind="dualpipev"'
SIZES = st.integers(1, 6).flatmap(lambda pp: st.tuples(st.just(pp),
                                                       st.integers(2 * pp, 3 * pp + 4)))


@settings(max_examples=40, deadline=None)
@given(SIZES)
def test_builder_runs_each_pass_once_in_the_v(size):
    pp, m = size
    sched = build("dualpipev", pp, m)
    res = simulate(sched)  # every transfer matched in order, F before B before W, no deadlock
    assert sched.virtual == 2 and len(sched.ranks) == pp
    for r, acts in enumerate(sched.ranks):
        assert [sched.stage(r, Action("F", 0, c)) for c in (0, 1)] == [r, 2 * pp - 1 - r]
        seen = [(a.kind, a.microbatch, a.c) for a in acts if a.kind in ("F", "B", "W")]
        assert len(seen) == len(set(seen))  # nothing twice
        for c in (0, 1):
            for kind in ("F", "B"):
                assert {mb for k, mb, cc in seen if (k, cc) == (kind, c)} == set(range(m))
        pos = {x: i for i, x in enumerate(seen)}
        split = deferred(acts)  # the cool-down's: 2(pp-r-1) + r+1 of them
        assert len(split) == 2 * pp - r - 1
        for mb, c in split:
            assert pos[("F", mb, c)] < pos[("B", mb, c)] < pos[("W", mb, c)]
        # steady state: m-2pp+r+1 times two F&B pairs, then pp-r-1 more (B1, then F1 with B0)
        assert len(fb_pairs(acts)) == 2 * (m - 2 * pp + r + 1) + pp - r - 1
        for i, j in fb_pairs(acts):
            assert acts[i].c != acts[j].c  # a forward on one chunk, a backward on the other
    n_moves = sum(a.kind in ("SF", "SB", "RF", "RB") for acts in sched.ranks for a in acts)
    assert n_moves == 2 * 2 * m * (2 * pp - 1)  # a send and a receive per boundary and pass
    # the DualPipe table's activations: PP+1 stage-microbatches per rank for PP = 2pp stages
    assert res.peak_inflight == [2 * pp + 1] * pp
    simulate(build("dualpipev", pp, m, forward_only=True))


@settings(max_examples=60, deadline=None)
@given(SIZES.filter(lambda s: s[0] > 1), st.floats(0.1, 1), st.floats(0, 1), st.floats(0, 1),
       st.floats(0, 1))
def test_simulator_reproduces_the_published_bubble(size, W, f, b, overlap):
    """(PP/2-1)(F&B + B - 3W) with PP = 2pp stages, B a whole backward, each F&B pair one
    unit: the idle time of the most idle rank, for W <= F <= B - W and F&B between the
    longer of F and B and their sum."""
    pp, m = size
    F = W + f
    B = F + W + b
    FB = max(F, B) + overlap * (F + B - max(F, B))
    sched = paired(build("dualpipev", pp, m))
    res = simulate(sched, costs=pair_costs(sched, F, B, W, FB))
    idle = max(res.makespan - busy for busy in res.busy)
    assert idle == pytest.approx((pp - 1) * (FB + B - 3 * W), rel=1e-9, abs=1e-9)


def test_memory_columns_of_the_dualpipe_table():
    """Per rank, against 1F1B on the same 2pp stages: twice the parameters (two stages per
    rank) and PP+1 stage-microbatches of activations instead of PP; the plan's estimate holds
    pp + 1/2 whole-rank microbatches on every rank, 2pp+1 against zbv's 2pp."""
    for pp in (2, 3, 4):
        one = simulate(build("1f1b", 2 * pp, 4 * pp))
        dual = simulate(build("dualpipev", pp, 4 * pp))
        assert dual.virtual / one.virtual == 2
        assert max(dual.peak_inflight) == max(one.peak_inflight) + 1 == 2 * pp + 1
        kind = ["topology.pp=2", "train.global_batch_size=16"]
        dpv = load(TINY, kind + ['schedule.kind="dualpipev"'])
        zbv = load(TINY, kind + ['schedule.kind="zbv"'])
        assert memory.in_flight(dpv) == 2.5 and memory.in_flight(zbv) == 2
        a, b = memory.estimate(dpv), memory.estimate(zbv)
        assert a.params == b.params  # the same V placement
        assert a.activations == pytest.approx(b.activations * 5 / 4, rel=1e-6)


def test_plan_search_offers_and_prices_dualpipev_for_experts():
    """``--search`` tries dualpipev where its pairs have all-to-alls to hide (MoE models)
    and prices it; fewer microbatches than 2pp are refused with the builder's message."""
    moe = load(TINY, ["model.num_experts=4", "model.moe_every=2", "train.global_batch_size=8"])
    kinds = {c.schedule.kind for c in search.layouts(moe, 4) if c.topology.pp > 1}
    assert "dualpipev" in kinds
    assert "dualpipev" not in {c.schedule.kind for c in search.layouts(load(TINY, []), 4)}
    layout = ["model.num_experts=4", "model.moe_every=2", "train.global_batch_size=8",
              "topology.pp=2", "topology.dp=2", "topology.ep=2"]
    on = cluster.load(cluster.shipped()[0])
    p = predict(load(TINY, [*layout, KIND]), on)
    assert p.step_s > 0 and p.step_s == pytest.approx(sum(p.parts.values()))
    assert 0 < p.bubble < predict(load(TINY, layout), on).bubble  # 1f1b's


def test_too_few_microbatches_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"at least 2\*pp = 8 microbatches .* there are 7"):
        build("dualpipev", 4, 7)
    over = ["topology.pp=4", 'schedule.kind="dualpipev"', "train.global_batch_size=4"]
    with pytest.raises(ConfigError, match="raise train.global_batch_size"):
        validate(load(TINY, over), 4)
    validate(load(TINY, over[:2] + ["train.global_batch_size=8"]), 4)


@pytest.mark.parametrize("pp,m", [(2, 5), (3, 9), (4, 8)])
def test_moe_overlap_runs_every_fb_pair_ping_pong(pp, m):
    """Each whole backward keeps its exchange segments (split ones keep theirs inside
    autograd), and every F&B pair is interleaved: the forward's exchanges travel while the
    other microbatch's backward computes, and the reverse."""
    model = ModelConfig(n_layers=2 * pp * 2, num_experts=4, moe_every=2)
    base = build("dualpipev", pp, m)
    sched = expand(base, moe_layers_per_stage(model, base.stages))
    simulate(sched)
    for r, acts in enumerate(sched.ranks):
        split = deferred(acts)
        assert all((a.microbatch, a.c) not in split for a in acts if a.kind in BACK_SEGMENTS)
        where = {}
        for k, a in enumerate(acts):
            side = "F" if a.kind in ("F", *SEGMENTS) else "B" if a.kind in (
                "B", *BACK_SEGMENTS) else None
            where.setdefault((side, a.microbatch, a.c), []).append(k)
        for i, j in fb_pairs(base.ranks[r]):
            f, b = base.ranks[r][i], base.ranks[r][j]
            fs, bs = where[("F", f.microbatch, f.c)], where[("B", b.microbatch, b.c)]
            assert min(bs) < max(fs) and min(fs) < max(bs), (r, str(f), str(b))


# -- the runner on one rank holding both stages of the V ----------------------------------
class Stage(torch.nn.Module):
    """A stage of weight matmuls (``weight_grad.linear``, so a split B defers them to W)."""

    def __init__(self, s: int, stages: int, d: int):
        super().__init__()
        g = torch.Generator().manual_seed(s)
        self.first, self.last = s == 0, s == stages - 1
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64) / d)

    def forward(self, h, y=None):
        if self.first:
            h = h.to(torch.float64).unsqueeze(-1).expand(*h.shape, self.w.shape[0]) / 9
        h = torch.tanh(weight_grad.linear(h, self.w))
        return (h.sum(-1) * y).sum() if self.last else h


def test_runner_mixes_whole_and_split_backwards_like_one_backward():
    pp, m, d = 1, 5, 4
    cfg = SimpleNamespace(
        schedule=SimpleNamespace(kind="dualpipev", virtual_stages=1, moe_overlap=False),
        experimental=SimpleNamespace(p2p_wait="spin"),
        topology=SimpleNamespace(pp=pp, sequence_parallel=False),
        model=SimpleNamespace(d_model=d, dtype="float64", device="cpu", num_experts=0),
        train=SimpleNamespace(micro_batch_size=2, seq_len=3))
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 9, (2, 3), generator=g), torch.randint(0, 9, (2, 3), generator=g))
           for _ in range(m)]
    ref = [Stage(s, 2, d) for s in range(2)]
    for x, y in mbs:
        (ref[1](ref[0](x), y) * 0.1).backward()
    stages = [Stage(s, 2, d) for s in range(2)]
    topo = SimpleNamespace(pp_rank=0, pp_size=pp, cp_size=1, tp_size=1, pp_comm=None)
    sched = build("dualpipev", pp, m)
    assert deferred(sched.ranks[0]) and any(
        a.kind == "B" and (a.microbatch, a.c) not in deferred(sched.ranks[0])
        for a in sched.ranks[0])  # both kinds of backward in one step
    loss, timing = run_step(stages, mbs, topo, cfg, 0.1)
    want = sum(float(ref[1](ref[0](x), y).detach()) for x, y in mbs)
    assert loss == pytest.approx(want, rel=1e-12)
    for mine, want in zip(stages, ref):
        torch.testing.assert_close(mine.w.grad, want.w.grad, rtol=1e-12, atol=0)
    assert timing["pp_peak_inflight"] == simulate(sched).peak_inflight[0]
