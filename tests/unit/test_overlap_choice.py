"""How overlapped gradient reductions progress, and where overlap turns itself on
(``optim.overlap_progress = "auto"``, ``optim.overlap_across_nodes``): the choices measured in
docs/results.md ("Overlapped gradient reduction")."""

from __future__ import annotations

import pytest
from fakes import fake_topology

from hpctrain.config import OptimConfig
from hpctrain.parallel.grad_sync import factory


def topo(dp_within_node: bool):
    return fake_topology(within_node={"dp": dp_within_node})


@pytest.mark.parametrize("crosses, overlap", [
    (True, True),    # across nodes: MPI_Test from the hooks, overlapped
    (False, False),  # inside a node: blocking buckets (overlap measured slower)
])
def test_auto(crosses, overlap):
    ocfg, t = OptimConfig(), topo(dp_within_node=not crosses)
    assert ocfg.overlap_progress == "auto"
    assert factory.progress_for(ocfg) == "test"
    assert factory.overlap_on(ocfg, t, "flat") is overlap


def test_an_explicit_choice_is_kept():
    ocfg = OptimConfig(overlap_progress="thread")
    assert factory.progress_for(ocfg) == "thread"
    assert factory.overlap_on(ocfg, topo(False), "flat")  # across nodes
    assert not factory.overlap_on(ocfg, topo(True), "flat")  # inside a node: off
    assert factory.overlap_on(OptimConfig(overlap=True), topo(True), "flat")


@pytest.mark.parametrize("change, reduction", [({"overlap_across_nodes": False}, "bucketed"),
                                               ({}, "per-parameter")])
def test_no_automatic_overlap_when_turned_off_or_naive(change, reduction):
    ocfg = OptimConfig(**change)
    assert not factory.overlap_on(ocfg, topo(False), "flat", reduction)


def test_not_with_hierarchical_reduction():
    assert not factory.overlap_on(OptimConfig(), topo(False), "hierarchical")
