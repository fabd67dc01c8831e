"""The gradient-sync factory: each configuration gets the strategy the table in
``parallel/grad_sync/factory.py`` documents, combinations no strategy supports are refused,
and every strategy implements the one interface (zero, reduce, close, buckets, grad_bytes)
with the sums of one rank equal to the plain backward's gradients. One process, no MPI: the
groups are fakes of one rank."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from fakes import D, OneRank, Stage
from hpctrain.parallel.grad_sync.blocking import BlockingBuckets
from hpctrain.parallel.grad_sync.hierarchical import HierarchicalBuckets
from hpctrain.parallel.grad_sync.nonblocking import NonblockingBuckets, OverlappedBuckets
from hpctrain.parallel.grad_sync.per_parameter import PerParameter
from hpctrain.parallel.grad_sync.zero3 import Zero3

from hpctrain.config import load
from hpctrain.parallel import grad_sync
from hpctrain.parallel.grad_sync import factory, hierarchical
from hpctrain.parallel.grad_sync.sharded import Zero1, Zero2


def _topo(cfg, crosses_nodes: bool = False):
    group = OneRank("dp")
    return SimpleNamespace(dpcp_comm=group, edpcp_comm=group, tp_comm=group, tp_size=1,
                           within_node={"dp": not crosses_nodes}, cfg=cfg.topology)


# (config overrides, dp groups cross nodes, the strategy): factory.py's table, row by row
CASES = [
    ([], False, BlockingBuckets),
    (["optim.overlap=true"], False, OverlappedBuckets),
    (['optim.overlap_progress="thread"'], True, OverlappedBuckets),  # across nodes
    (['optim.overlap_progress="thread"'], False, BlockingBuckets),  # inside a node: off
    (['experimental.reduction="bucketed-nonblocking"'], True, NonblockingBuckets),
    (['experimental.reduction="per-parameter"'], False, PerParameter),
    (['topology.dp_reduction="hierarchical"'], True, HierarchicalBuckets),
    (["optim.zero=1"], False, Zero1),
    (["optim.zero=1", "optim.overlap=true"], False, Zero1),
    (["optim.zero=2"], False, Zero2),
    (["optim.zero=3"], False, Zero3),
]


def _build(overrides, crosses, monkeypatch):
    cfg = load(None, ['model.dtype="float64"', "optim.bucket_mb=0.0001", *overrides])
    topo = _topo(cfg, crosses)
    if cfg.topology.dp_reduction == "hierarchical":  # the two-level split needs MPI
        monkeypatch.setattr(hierarchical, "levels", lambda t: {
            "dp": SimpleNamespace(group=t.dpcp_comm), "edp": SimpleNamespace(group=t.dpcp_comm)})
    torch.manual_seed(0)
    stage = Stage()
    return cfg, stage, grad_sync.build(cfg, topo, [stage], list(stage.named_parameters()))


@pytest.mark.parametrize("overrides, crosses, want", CASES)
def test_build_picks_the_documented_strategy(overrides, crosses, want, monkeypatch):
    cfg, _, grads = _build(overrides, crosses, monkeypatch)
    assert type(grads) is want
    assert grads.zero_level == cfg.optim.zero
    assert grads.overlap == (want in (OverlappedBuckets, Zero2, Zero3) or cfg.optim.overlap)
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
    (0, False, "per-parameter", "hierarchical"), (0, True, "bucketed", "hierarchical")])
def test_unsupported_combinations_are_refused(zero, overlap, mode, dp_reduction):
    with pytest.raises(ValueError):
        grad_sync.choose(zero, overlap, mode, dp_reduction)


def test_every_strategy_implements_the_interface():
    names = set()
    for cls in grad_sync.STRATEGIES:
        assert issubclass(cls, grad_sync.GradSync) and not inspect.isabstract(cls), cls
        for method in ("zero", "reduce", "close", "grad_bytes", "segments", "sp_ranges"):
            assert callable(getattr(cls, method)), (cls, method)
        assert cls.name and cls.name not in names, cls
        names.add(cls.name)
    # nothing skips the interface: a strategy without _sum cannot be made
    with pytest.raises(TypeError):
        type("Incomplete", (grad_sync.GradSync,), {})(None)


def test_the_documented_table_names_every_strategy_and_its_module():
    rows = re.findall(r"^\S.*?\s{2,}(\w+)\s{2,}(\w+)\.py$", factory.__doc__, re.M)
    table = {cls: module for cls, module in rows}
    assert set(table) == {c.__name__ for c in grad_sync.STRATEGIES}
    for cls in grad_sync.STRATEGIES:
        assert cls.__module__.rsplit(".", 1)[1] == table[cls.__name__], cls
