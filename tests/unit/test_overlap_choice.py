"""How overlapped gradient reductions progress, and where overlap turns itself on
(``optim.overlap_progress = "auto"``, ``optim.overlap_across_nodes``): the choices measured in
docs/results.md ("Overlapped gradient reduction")."""

from __future__ import annotations

import pytest
from fakes import fake_topology

from hpctrain import comm
from hpctrain.config import OptimConfig
from hpctrain.parallel.grad_sync import factory


def topo(dp_within_node: bool):
    return fake_topology(within_node={"dp": dp_within_node})


@pytest.fixture
def multiple(monkeypatch):
    def set_level(ok: bool):
        level = "MPI_THREAD_MULTIPLE" if ok else "MPI_THREAD_SERIALIZED"
        monkeypatch.setattr(comm, "thread_multiple", lambda: (ok, level))
    return set_level


@pytest.mark.parametrize("crosses, has_multiple, progress, overlap", [
    (True, True, "thread", True),    # across nodes with a thread-safe MPI: progress thread
    (True, False, "test", False),    # no THREAD_MULTIPLE: test loses over TCP, no overlap
    (False, True, "test", False),    # inside a node: blocking buckets (overlap measured slower)
    (False, False, "test", False),
])
def test_auto(multiple, crosses, has_multiple, progress, overlap):
    multiple(has_multiple)
    ocfg, t = OptimConfig(), topo(dp_within_node=not crosses)
    assert ocfg.overlap_progress == "auto"
    assert factory.progress_for(ocfg, t) == progress
    assert factory.overlap_on(ocfg, t, "flat", factory.progress_for(ocfg, t)) is overlap


def test_an_explicit_choice_is_kept(multiple):
    multiple(False)
    ocfg = OptimConfig(overlap_progress="test")
    assert factory.progress_for(ocfg, topo(False)) == "test"
    assert factory.overlap_on(ocfg, topo(False), "flat", "test")  # the user asked for test
    assert not factory.overlap_on(ocfg, topo(True), "flat", "test")  # inside a node: off
    assert factory.overlap_on(OptimConfig(overlap=True), topo(True), "flat", "test")


@pytest.mark.parametrize("change, reduction", [({"overlap_across_nodes": False}, "bucketed"),
                                               ({}, "per-parameter")])
def test_no_automatic_overlap_when_turned_off_or_naive(multiple, change, reduction):
    multiple(True)
    ocfg = OptimConfig(**change)
    progress = factory.progress_for(ocfg, topo(False))
    assert not factory.overlap_on(ocfg, topo(False), "flat", progress, reduction)


def test_not_with_hierarchical_reduction(multiple):
    multiple(True)
    ocfg = OptimConfig()
    assert not factory.overlap_on(ocfg, topo(False), "hierarchical", "thread")
