"""The gradient-sync factory: each configuration gets the strategy the registry in
``parallel/grad_sync/factory.py`` (``TABLE``) selects, combinations no strategy supports are
refused (by the config checks too, with the factory's message), every strategy implements
the one interface (zero, reduce, close, buckets, grad_bytes) with the sums of one rank equal
to the plain backward's gradients, and a strategy registered by one row is built, priced by
the planner and checked. One process, no MPI: the groups are fakes of one rank."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes import D, OneRank, Stage

from hpctrain.checks.rules import problems
from hpctrain.config import load
from hpctrain.parallel import grad_sync
from hpctrain.parallel.grad_sync import buckets, factory
from hpctrain.parallel.grad_sync.buckets import (
    BlockingBuckets,
    HierarchicalBuckets,
    NonblockingBuckets,
    OverlappedBuckets,
    OverlappedHierarchical,
    PerParameter,
)
from hpctrain.parallel.grad_sync.sharded import Zero1, Zero2, Zero3
from hpctrain.planner.cluster import load as load_cluster
from hpctrain.planner.cluster import shipped
from hpctrain.planner.cost import predict
from hpctrain.planner.memory import estimate

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")


def _topo(cfg, crosses_nodes: bool = False):
    group = OneRank("dp")
    return SimpleNamespace(dpcp_comm=group, edpcp_comm=group, tp_comm=group, tp_size=1,
                           within_node={"dp": not crosses_nodes}, cfg=cfg.topology)


# (config overrides, dp groups cross nodes, the strategy): factory.TABLE, row by row
CASES = [
    ([], False, BlockingBuckets),
    (["optim.overlap=true"], False, OverlappedBuckets),
    ([], True, OverlappedBuckets),  # across nodes: overlapped by default
    (['optim.overlap_progress="thread"'], True, OverlappedBuckets),
    (['optim.overlap_progress="thread"'], False, BlockingBuckets),  # inside a node: off
    (['experimental.reduction="bucketed-nonblocking"'], True, NonblockingBuckets),
    (['experimental.reduction="per-parameter"'], False, PerParameter),
    (['topology.dp_reduction="hierarchical"'], True, HierarchicalBuckets),
    (['topology.dp_reduction="hierarchical"', "optim.overlap=true"], True,
     OverlappedHierarchical),
    (["optim.zero=1"], False, Zero1),
    (["optim.zero=1", "optim.overlap=true"], False, Zero1),
    (["optim.zero=2"], False, Zero2),
    (["optim.zero=3"], False, Zero3),
]


def _build(overrides, crosses, monkeypatch):
    cfg = load(None, ['model.dtype="float64"', "optim.bucket_mb=0.0001", *overrides])
    topo = _topo(cfg, crosses)
    if cfg.topology.dp_reduction == "hierarchical":  # the two-level split needs MPI
        monkeypatch.setattr(buckets, "levels", lambda t: {
            "dp": SimpleNamespace(group=t.dpcp_comm), "edp": SimpleNamespace(group=t.dpcp_comm)})
    torch.manual_seed(0)
    stage = Stage()
    return cfg, stage, grad_sync.build(cfg, topo, [stage], list(stage.named_parameters()))


@pytest.mark.parametrize("overrides, crosses, want", CASES)
def test_build_picks_the_documented_strategy(overrides, crosses, want, monkeypatch):
    cfg, _, grads = _build(overrides, crosses, monkeypatch)
    assert type(grads) is want
    assert grads.zero_level == cfg.optim.zero
    assert grads.overlap == (want in (OverlappedBuckets, OverlappedHierarchical, Zero2, Zero3)
                             or cfg.optim.overlap)
    assert (grads.sharded is not None) == (want is Zero3)
    grads.close()


@pytest.mark.parametrize("overrides, crosses, want", CASES)
def test_every_strategy_sums_like_one_backward(overrides, crosses, want, monkeypatch):
    """One rank, two steps of two microbatches: each strategy's reduced gradient (full or
    the shard) equals the plain backward's, to 1e-12 in float64."""
    _, stage, grads = _build(overrides, crosses, monkeypatch)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    named = list(stage.named_parameters())
    for _ in range(2):
        grads.zero()
        for xs in x:
            stage(xs).backward()
        grads.reduce()
    ref = Stage()
    if grads.sharded is None:
        ref.load_state_dict({n: p.detach() for n, p in named})
    else:  # ZeRO-3: the parameters live in the shards (one rank: the whole bucket)
        for b in grads.buckets:
            for name, p, off in zip(b.names, b.params, b.offsets):
                ref.get_parameter(name).data.copy_(b.pshard[off:off + p.numel()].view_as(p))
    for xs in x:
        ref(xs).backward()
    for b in grads.buckets:
        for name, p, off in zip(b.names, b.params, b.offsets):
            got = (b.shard if grads.zero_level else b.flat)[off:off + p.numel()]
            want_g = ref.get_parameter(name).grad.reshape(-1)
            assert torch.allclose(got, want_g, rtol=1e-12, atol=1e-15), name
    assert grads.grad_bytes() > 0
    grads.close()


@pytest.mark.parametrize("zero, overlap, mode, dp_reduction", [
    (1, False, "bucketed", "hierarchical"), (2, True, "bucketed", "hierarchical"),
    (0, True, "per-parameter", "flat"), (1, False, "bucketed-nonblocking", "flat"),
    (0, False, "per-parameter", "hierarchical")])
def test_unsupported_combinations_are_refused(zero, overlap, mode, dp_reduction):
    """The factory refuses, and the config checks report its message (the key and the fix)."""
    with pytest.raises(ValueError) as e:
        grad_sync.choose(zero, overlap, mode, dp_reduction)
    assert "needs" in str(e.value)
    cfg = load(TINY, ["topology.dp=2", f"optim.zero={zero}",
                      f"optim.overlap={str(overlap).lower()}", f'experimental.reduction="{mode}"',
                      f'topology.dp_reduction="{dp_reduction}"'])
    assert str(e.value) in problems(cfg, 2)


def test_every_strategy_implements_the_interface():
    names = set()
    for cls in grad_sync.strategies():
        assert issubclass(cls, grad_sync.GradSync) and not inspect.isabstract(cls), cls
        for method in ("zero", "reduce", "close", "grad_bytes", "segments", "sp_ranges"):
            assert callable(getattr(cls, method)), (cls, method)
        assert cls.name and cls.name not in names, cls
        names.add(cls.name)
    # nothing skips the interface: a strategy without _sum cannot be made
    with pytest.raises(TypeError):
        type("Incomplete", (grad_sync.GradSync,), {})(None)


def test_every_row_of_the_registry_has_a_case():
    assert {want for _, _, want in CASES} == set(grad_sync.strategies())


# -- a strategy registered by one row: built, priced by the planner, checked -------------
class Example(BlockingBuckets):
    """Blocking buckets that price themselves apart: three gradient copies, 7 bytes per
    parameter over dp, 123 s of reduction."""

    name = "example"

    @classmethod
    def memory(cls, cfg, P, ps, gathered):
        return P * ps, 3 * P * ps

    @classmethod
    def dp_bytes(cls, cfg, P, ps, M):
        return 7 * P

    @classmethod
    def dp_seconds(cls, net, P, nb):
        return 123.0


EXAMPLE = factory.Row(f"{__name__}:Example", lambda c: c.mode == "per-parameter",
                      lambda c: "the example needs optim.zero=0" if c.zero else None)


def test_a_registered_strategy_is_built_priced_and_checked(monkeypatch):
    monkeypatch.setattr(factory, "TABLE", [EXAMPLE, *factory.TABLE])
    _, _, grads = _build(['experimental.reduction="per-parameter"'], False, monkeypatch)
    assert type(grads) is Example
    grads.close()
    cfg = load(TINY, ["topology.dp=2", 'experimental.reduction="per-parameter"'])
    assert problems(cfg, 2) == []
    mem = estimate(cfg)
    assert mem.grads == 3 * mem.params and mem.comm["dp"] == 7 * mem.elements
    assert predict(cfg, load_cluster(shipped()[0])).parts["dp"] == 123.0
    refused = load(TINY, ["topology.dp=2", "optim.zero=1",
                          'experimental.reduction="per-parameter"'])
    assert "the example needs optim.zero=0" in problems(refused, 2)
