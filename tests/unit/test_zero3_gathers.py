"""ZeRO-3's all-gathers per unit and microbatch, counted on one process (no MPI).

One pp rank of a tiny-llama pipeline runs its real schedule (``pipeline.runner.run_step``)
with neighbours faked (``fakes.Pipe``) and its parameters sharded over a
``fakes.GuardedGroup``, which fails on an all-gather posted into a buffer in flight or in use
and on a backward that reads a buffer not gathered. Per microbatch: every unit is gathered
once for its forward; once for its backward (``B``), except the embedding (its backward is a
scatter-add of the gradient: it reads no weight); ``W`` gathers nothing. Units: each block;
``embed`` (the first stage's embedding); ``head`` (the last stage's final norm and head, and
the embedding too when tied). pp=1 is pinned event by event (post, wait, free), and its
gradients equal one plain backward's.
"""

import pytest
import torch
from fakes import Actions, GuardedGroup, Pipe, fake_topology

from hpctrain.config import load, microbatches
from hpctrain.parallel import grad_sync
from hpctrain.parallel.build import build_model, named_parameters
from hpctrain.pipeline.actions import parse
from hpctrain.pipeline.runner import run_step

TINY = "share/configs/tiny-llama.toml"


def unit_name(unit, names) -> str:
    got = sorted(names[id(p)] for b in unit.buckets for p in b.params)
    if got[0].startswith("blocks."):
        return "b" + got[0].split(".")[1]
    return "embed" if got == ["embed"] else "head"


def run_rank(monkeypatch, pp: int, rank: int, *overrides, m: int = 4):
    """One step of pp rank ``rank``: (group, {unit name: unit}, chunk unit names, sharded,
    unit name by storage key)."""
    cfg = load(TINY, [f"topology.pp={pp}", f"train.global_batch_size={m}", *overrides])
    group = GuardedGroup()
    group.watch(monkeypatch)
    topo = fake_topology(group=group, pp_size=pp, pp_rank=rank, cp_size=1, local_rank=0,
                         pp_comm=Pipe())
    torch.manual_seed(0)
    chunks = build_model(cfg, topo)
    named = named_parameters(chunks)
    grads = grad_sync.create(named, topo, cfg.optim.bucket_mb, zero=3,
                             microbatches=microbatches(cfg), chunks=chunks)
    grads.zero()
    sharded = grads.sharded
    names = {id(p): n for n, p in named}
    units = {unit_name(u, names): u for u in sharded.units}
    of_key = {GuardedGroup.key(b.full): n for n, u in units.items() for b in u.buckets}
    chunk_units = [{n for n, u in units.items() if u.ids <= {id(p) for p in c.parameters()}}
                   for c in chunks]
    B, T, V = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    mbs = [(torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)))
           for _ in range(microbatches(cfg))]
    with group.reads():
        run_step(chunks, mbs, topo, cfg, 1.0 / (m * T), Actions(group), sharded)
    grads.reduce()
    assert not group.errors and not group.flight and sharded.live == 0
    if pp == 1:  # the gradients of one plain backward of the same model (float64, 1e-12)
        ref = build_model(cfg, fake_topology(cp_size=1, local_rank=0, pp_size=1, pp_rank=0))
        for x, y in mbs:
            (ref[0](x, y) / (m * T)).backward()
        want = dict(ref[0].named_parameters())
        for b in grads.buckets:
            for p, off in zip(b.params, b.offsets):
                torch.testing.assert_close(b.shard[off:off + p.numel()].view_as(p),
                                           want[names[id(p)]].grad, rtol=1e-12, atol=0)
    return group, units, chunk_units, sharded, of_key


def gathers_by_action(group, of_key) -> dict:
    out: dict = {}
    for label, kind, key, _ in group.events:
        if kind == "post":
            out.setdefault(label, []).append(of_key[key])
    return out


def assert_exact_counts(group, of_key, chunk_units, kinds) -> None:
    seen = gathers_by_action(group, of_key)
    assert set(seen) <= kinds, seen.keys() - kinds  # only F and B gather
    for label in kinds:
        a = parse(label)
        if a.kind not in ("F", "B"):
            continue
        want = sorted(chunk_units[a.c] - ({"embed"} if a.kind == "B" else set()))
        assert sorted(seen.get(label, [])) == want, label


LAYOUTS = [  # (pp, overrides, ranks)
    (2, ['schedule.kind="1f1b"'], (0, 1)),
    (3, ['schedule.kind="1f1b"'], (0, 1, 2)),
    (3, ['schedule.kind="gpipe"'], (0, 1, 2)),
    (3, ['schedule.kind="zb-h1"'], (0, 1, 2)),
    (2, ['schedule.kind="interleaved"', "schedule.virtual_stages=2"], (0, 1)),
    (2, ['schedule.kind="zbv"'], (0, 1)),
    (2, ['schedule.kind="dualpipev"'], (0, 1)),  # whole and split backwards in one step
]


@pytest.mark.parametrize("pp,overrides,ranks", LAYOUTS,
                         ids=["1f1b-pp2", "1f1b-pp3", "gpipe-pp3", "zb-h1-pp3",
                              "interleaved-pp2", "zbv-pp2", "dualpipev-pp2"])
def test_each_unit_is_gathered_once_per_forward_and_backward(monkeypatch, pp, overrides,
                                                             ranks):
    """First, middle and last stages: per microbatch each unit once in F, once in B (the
    embedding never in B), nothing in W, never into a buffer in flight or in use."""
    for rank in ranks:
        with monkeypatch.context() as mp:
            group, _, chunk_units, _, of_key = run_rank(mp, pp, rank, "model.n_layers=6",
                                                        *overrides)
        kinds = {label for label, *_ in group.events} | {
            label for label in gathers_by_action(group, of_key)}
        assert_exact_counts(group, of_key, chunk_units, kinds)


# pp = 1, two blocks: one microbatch's events, (unit, post | done | free), forward then
# backward, the same for every microbatch
UNTIED = ["post embed", "done embed", "post b0", "free embed", "done b0", "post b1",
          "free b0", "done b1", "post head", "free b1", "done head", "free head",
          "post head", "done head", "post b1", "free head", "done b1", "post b0", "free b1",
          "done b0", "free b0"]
TIED = ["post head", "done head", "post b0", "done b0", "post b1", "free b0", "done b1",
        "free b1", "free head",
        "post head", "done head", "post b1", "done b1", "free head", "post b0", "free b1",
        "done b0", "free b0"]


@pytest.mark.parametrize("tied", [False, True])
def test_one_stage_sequence_and_the_root_released_when_unused(monkeypatch, tied):
    """pp=1: the embedding is freed once block 0 starts and not gathered for its backward;
    the head (final norm and head; with the embedding when tied) is gathered for the head's
    forward and backward and freed once the last block's backward starts."""
    extra = ["model.tie_embeddings=true"] if tied else []
    group, units, chunk_units, sharded, of_key = run_rank(
        monkeypatch, 1, 0, "model.n_layers=2", *extra, m=2)
    per_mb: dict = {}
    for label, kind, key, _ in group.events:
        mb = parse(label).microbatch
        per_mb.setdefault(mb, []).append(f"{kind} {of_key[key]}")
    want = TIED if tied else UNTIED
    assert per_mb == {0: want, 1: want}
    kinds = {label for label, *_ in group.events}
    assert_exact_counts(group, of_key, chunk_units, kinds)
    block, head = units["b0"].nbytes, units["head"].nbytes
    # at most one root and two blocks; the tied head is held from the embedding to the head
    most = head + 2 * block if tied else max(units["embed"].nbytes, head, block) + block
    assert units["b1"].nbytes == block and sharded.take_peak() == most


def test_the_guard_catches_each_misuse(monkeypatch):
    """The fake group fails a post into a buffer in flight or in use, and a backward that
    reads a released buffer."""
    from hpctrain.parallel.grad_sync import sharded

    group = GuardedGroup()
    group.watch(monkeypatch)
    buf, shard = torch.zeros(4), torch.ones(4)
    handle = group.iallgather(shard, buf)
    with pytest.raises(AssertionError, match="in flight"):
        group.iallgather(shard, buf)
    handle.wait()
    with pytest.raises(AssertionError, match="in use"):
        group.iallgather(shard, buf)
    x = torch.ones(4, requires_grad=True)
    with group.reads():
        y = (x * buf).sum()  # saves buf for the backward
        sharded._free(buf)  # released: the group is told
        with pytest.raises(AssertionError, match="not gathered"):
            y.backward()
