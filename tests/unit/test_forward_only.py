"""Evaluation's forward-only schedules (``actions.build(..., forward_only=True)``) and their
execution (``runner.run_forward``).

For every schedule kind and pp/virtual size the forward-only schedule is sound by the
simulator, holds each (microbatch, chunk) forward once and nothing else but its transfers,
and uses the training schedule's links (``actions.link``: same peers, same tags). Evaluation
messages never meet training's: a training step, an evaluation and another step posted back
to back on every rank match link by link only within their own pass. ``run_forward`` on
threads that stand in for the pp ranks returns the loss of the stages composed on one rank,
under ``torch.no_grad``."""

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from hpctrain.config import ModelConfig
from hpctrain.pipeline.actions import Action, Schedule, link
from hpctrain.pipeline.moe_overlap import expand, moe_layers_per_stage
from hpctrain.pipeline.runner import run_forward
from hpctrain.pipeline.schedules import KINDS, build
from hpctrain.pipeline.simulate import ScheduleError, match, simulate

MPI_MIN_TAG_UB = 32767  # the least MPI_TAG_UB the standard allows
TRANSFERS = ("RF", "SF", "RB", "SB")


def layouts():
    """(kind, pp, virtual, microbatches) for every kind, several pp and virtual sizes."""
    out = []
    for kind in KINDS:
        virtuals = ((2, 3) if kind == "interleaved" else (2,) if kind in ("zbv", "dualpipev")
                    else (1,))
        for pp in (1, 2, 3, 4):
            for v in virtuals:
                for m in (1, 2, 4, 8, 12):
                    if kind == "interleaved" and m % pp or kind == "dualpipev" and m < 2 * pp:
                        continue
                    out.append((kind, pp, v, m))
    return out


@pytest.mark.parametrize("kind,pp,v,m", layouts())
def test_forward_only_schedule_is_sound_and_uses_the_training_links(kind, pp, v, m):
    train, fwd = build(kind, pp, m, v), build(kind, pp, m, v, forward_only=True)
    assert fwd.forward_only and not train.forward_only
    simulate(fwd)  # matching, order, deadlock
    for r in range(pp):
        acts = fwd.ranks[r]
        assert {a.kind for a in acts} <= {"F", "RF", "SF"}
        forwards = [a for a in acts if a.kind == "F"]
        assert len(forwards) == len(set(forwards)) == m * fwd.virtual
        assert forwards == [a for a in train.ranks[r] if a.kind == "F"]  # the kind's order
        moves = [a for a in acts if a.kind in TRANSFERS]
        assert set(moves) == {a for a in train.ranks[r] if a.kind in ("RF", "SF")}
        for a in moves:
            peer, tag = fwd.peer(r, a)
            assert (peer, tag) == train.peer(r, a) == link(a, fwd.stage(r, a), pp, fwd.style)
            assert 0 <= tag <= 2 * fwd.stages <= MPI_MIN_TAG_UB


def test_runner_tags_are_small():
    # The pipeline runner's tags (2 * stage + 1 at most) fit MPI's least TAG_UB for any
    # stage count the trainer can build (pp * virtual_stages < 16384).
    stages = 64 * 8
    tags = [link(Action(k, 0), s, 64)[1] for s in range(stages) for k in ("SF", "RF", "SB", "RB")]
    assert max(tags) <= 2 * stages <= MPI_MIN_TAG_UB


def _renumbered(sched: Schedule, offset: int):
    return [[Action(a.kind, a.microbatch + offset, a.chunk) for a in acts]
            for acts in sched.ranks]


@pytest.mark.parametrize("kind,pp,v,m", [x for x in layouts() if x[1] > 1 and x[3] > 1])
def test_evaluation_messages_never_meet_training_messages(kind, pp, v, m):
    # step, evaluation, step on every rank, the passes' microbatches numbered apart: MPI
    # matching on the shared links pairs each receive with a send of its own microbatch.
    train, fwd = build(kind, pp, m, v), build(kind, pp, m, v, forward_only=True)
    passes = [_renumbered(train, 0), _renumbered(fwd, m), _renumbered(train, 2 * m)]
    ranks = tuple(tuple(a for p in passes for a in p[r]) for r in range(pp))
    pairs = match(Schedule(kind, pp, train.virtual, 3 * m, ranks, style=train.style))
    assert len(pairs) == sum(a.kind in ("RF", "RB") for acts in ranks for a in acts)


def test_a_backward_in_a_forward_only_schedule_is_refused():
    fwd = build("1f1b", 2, 2, forward_only=True)
    bad = Schedule("1f1b", 2, 1, 2, (fwd.ranks[0], fwd.ranks[1] + (Action("B", 0),)), True)
    with pytest.raises(ScheduleError, match="forward-only schedule has a backward"):
        simulate(bad)
    missing = Schedule("1f1b", 2, 1, 2, (fwd.ranks[0][:-2], fwd.ranks[1]), True)
    with pytest.raises(ScheduleError):
        simulate(missing)


def test_forward_only_activations_live_from_forward_to_send():
    assert simulate(build("gpipe", 4, 8, forward_only=True)).peak_inflight == [1] * 4
    assert simulate(build("gpipe", 4, 8)).peak_inflight == [8] * 4


@pytest.mark.parametrize("kind,pp,m,v", [("1f1b", 2, 4, 1), ("gpipe", 2, 2, 1),
                                         ("interleaved", 2, 4, 2), ("zbv", 2, 3, 2),
                                         ("zb-h1", 2, 4, 1)])
def test_moe_overlap_expands_the_forward_only_schedule(kind, pp, m, v):
    cfg = ModelConfig(n_layers=8, num_experts=4, moe_every=2)
    fwd = build(kind, pp, m, v, forward_only=True)
    sched = expand(fwd, moe_layers_per_stage(cfg, fwd.stages))
    assert sched.forward_only
    simulate(sched)
    kinds = {a.kind for acts in sched.ranks for a in acts}
    assert {"D", "E", "C", "G"} <= kinds and not kinds & {"B", "W", "CB", "XB", "DB", "YB"}


# -- run_forward on threads standing in for the pp ranks ----------------------------------
class Links:
    """In-process point-to-point: one FIFO per (source, dest, tag), as MPI matches."""

    def __init__(self):
        self.lock, self.boxes = threading.Lock(), {}

    def box(self, key) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())


class Comm:
    def __init__(self, links: Links, rank: int):
        self.links, self.rank, self.tags = links, rank, []

    def isend(self, t, dest, tag=0):
        self.tags.append(tag)
        self.links.box((self.rank, dest, tag)).put(t.clone())
        return SimpleNamespace(wait=lambda: None)

    def irecv(self, buf, source, tag=0):
        self.tags.append(tag)
        box = self.links.box((source, self.rank, tag))
        return SimpleNamespace(wait=lambda: buf.copy_(box.get(timeout=30)))


class Stage(torch.nn.Module):
    """Virtual stage ``s``: the first embeds token ids, every stage adds ``s + 1`` times its
    weight, the last returns the loss sum against the targets."""

    def __init__(self, s: int, stages: int, d: int):
        super().__init__()
        self.s, self.first, self.last = s, s == 0, s == stages - 1
        self.w = torch.nn.Parameter(torch.full((d,), 0.5, dtype=torch.float64))
        self.grad_seen = []

    def forward(self, h, y=None):
        self.grad_seen.append(torch.is_grad_enabled())
        if self.first:
            h = h.to(torch.float64).unsqueeze(-1) * self.w
        h = h + (self.s + 1) * self.w
        return (h.sum(-1) * y).sum() if self.last else h


def _cfg(kind, pp, v, mbs=2, seq=3, d=4):
    return SimpleNamespace(
        schedule=SimpleNamespace(kind=kind, virtual_stages=v, moe_overlap=False),
        experimental=SimpleNamespace(p2p_wait="spin"),
        topology=SimpleNamespace(pp=pp, sequence_parallel=False),
        model=SimpleNamespace(d_model=d, dtype="float64", device="cpu", num_experts=0),
        train=SimpleNamespace(micro_batch_size=mbs, seq_len=seq))


@pytest.mark.parametrize("kind,pp,v,m", [("1f1b", 3, 1, 4), ("gpipe", 2, 1, 3),
                                         ("interleaved", 2, 2, 4), ("zbv", 2, 2, 3),
                                         ("zbv", 3, 2, 5), ("zb-h1", 2, 1, 2)])
def test_run_forward_equals_the_stages_composed_on_one_rank(kind, pp, v, m):
    cfg = _cfg(kind, pp, v)
    fwd = build(kind, pp, m, v, forward_only=True)
    stages = [Stage(s, fwd.stages, cfg.model.d_model) for s in range(fwd.stages)]
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 9, (2, 3), generator=g), torch.randint(0, 9, (2, 3), generator=g))
           for _ in range(m)]
    want = 0.0
    for x, y in mbs:
        h = x
        for st in stages:
            h = st(h, y if st.last else None)
        want += float(h.detach())
    links, results, comms = Links(), {}, {}

    def rank(r: int):
        chunks = [stages[fwd.stage(r, Action("F", 0, c))] for c in range(fwd.virtual)]
        comms[r] = Comm(links, r)
        topo = SimpleNamespace(pp_rank=r, pp_size=pp, cp_size=1, tp_size=1, pp_comm=comms[r])
        results[r] = run_forward(chunks, mbs, topo, cfg)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    owner = fwd.stage(0, Action("F", 0, fwd.virtual - 1)) == fwd.stages - 1  # zbv: rank 0
    last = 0 if owner else pp - 1
    assert results[last] == pytest.approx(want, rel=1e-12)
    assert all(results[r] == 0.0 for r in range(pp) if r != last)
    assert not any(seen for st in stages for seen in st.grad_seen[m:])  # no graph
    assert all(0 <= t <= 2 * fwd.stages for c in comms.values() for t in c.tags)
