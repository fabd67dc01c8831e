"""What the cost model charges a node's shared link, the 16-bit software sum and a progress
thread that spins on a shared core (no MPI): ``Link.carrying``, ``collectives.summed``,
``cost.exposed``, and ``predict`` deciding overlap as a run does
(``grad_sync.factory.decided``). What ``plan --calibrate`` measures for them:
tests/mpi/test_calibrate_mpi.py."""

import dataclasses

import pytest
import tomllib
from launch import TINY

from hpctrain.config import load
from hpctrain.parallel.grad_sync import buckets
from hpctrain.parallel.grad_sync.factory import decided, strategy_of
from hpctrain.planner.cluster import Link, dumps, from_dict
from hpctrain.planner.collectives import allreduce, scatter, summed
from hpctrain.planner.cost import exposed, predict

NODES = from_dict({  # 2 ranks per node on one 25 MB/s link, as the simulated nodes
    "name": "two-per-link", "ranks_per_node": 2, "memory": 2**36, "efficiency": 0.5,
    "peak_flops": {"float32": 1e11}, "compute_share": 0.5,
    "link": {"intra": {"latency": 1e-5, "bandwidth": 2e9},
             "inter": {"latency": 1e-3, "bandwidth": 2.5e7, "ports": 1}}})


def _own_ports(c):
    return dataclasses.replace(c, inter=dataclasses.replace(c.inter, ports=0))


def test_a_link_is_shared_by_the_flows_beyond_its_ports():
    one, own = Link(1e-3, 1e8, ports=1), Link(1e-3, 1e8)
    assert one.carrying(1) is one and own.carrying(8) is own
    assert one.carrying(4).bandwidth == pytest.approx(2.5e7)
    assert Link(0, 1e8, ports=2).carrying(4).bandwidth == pytest.approx(5e7)
    assert one.carrying(4).latency == one.latency


def test_ports_round_trip_through_the_description():
    again = from_dict(tomllib.loads(dumps(NODES)))
    assert again.inter.ports == 1 and again.intra.ports == 0
    assert again == dataclasses.replace(NODES, name=again.name)


def test_a_fraction_of_ports_is_what_several_flows_carry_together():
    """The simulated nodes: two flows carry 1.49x one (``calibrate.ports_of``); the
    description keeps the fraction, and two flows share it."""
    link = Link(0, 1.6e7, ports=1.49)
    assert link.carrying(1) is link
    assert link.carrying(2).bandwidth == pytest.approx(1.6e7 * 1.49 / 2)
    frac = dataclasses.replace(NODES, inter=link)
    assert from_dict(tomllib.loads(dumps(frac))).inter.ports == 1.49


def test_hierarchical_rings_share_the_node_link():
    """2 nodes x 2 ranks: the hierarchical all-reduce's 2 rings of n/2 cross one link at
    once, so its cross-node part costs what one ring of n would carry, not half."""
    n, intra, link = 1e7, NODES.intra, NODES.inter
    got = allreduce(n, 4, link, "hierarchical", 2, intra) - 2 * scatter(n, 2, intra)
    assert got == pytest.approx(allreduce(n / 2, 2, Link(link.latency, link.bandwidth / 2)))
    alone = allreduce(n, 4, Link(link.latency, link.bandwidth), "hierarchical", 2, intra)
    assert alone < got + 2 * scatter(n, 2, intra)


def test_dp_groups_that_cross_together_share_the_link():
    """dp=2 x tp=2 on 2 nodes of 2: both dp groups cross at once; each gets half the link."""
    cfg = load(TINY, ['model.dtype="float32"', "topology.dp=2", "topology.tp=2",
                      "optim.overlap_across_nodes=false"])
    bytes_only = dataclasses.replace(NODES, inter=dataclasses.replace(NODES.inter, latency=0))
    shared, own = predict(cfg, bytes_only), predict(cfg, _own_ports(bytes_only))
    assert shared.links["dp"] == "inter"
    assert shared.parts["dp"] == pytest.approx(2 * own.parts["dp"]) and own.parts["dp"] > 0


def test_the_16_bit_sum_is_charged_per_element_added():
    assert summed(1000, 1) == 0 and summed(1000, 4) == 750
    assert summed(1000, 8, "hierarchical", 2) == pytest.approx(500 + 0.75 * 500)
    base = ['model.dtype="float32"', "topology.dp=4", "optim.overlap_across_nodes=false"]
    bf16 = [*base, 'optim.grad_comm_dtype="bfloat16"']
    slow_sum = dataclasses.replace(NODES, sum16_s=1e-8)
    for sets, charged in ((bf16, True), (base, False)):
        cfg = load(TINY, sets)
        extra = predict(cfg, slow_sum).parts["dp"] - predict(cfg, NODES).parts["dp"]
        P = predict(cfg, NODES).memory.elements
        assert extra == pytest.approx(0.75 * P * 1e-8 if charged else 0.0, rel=1e-6)


def test_a_spinning_thread_halves_the_backward_it_overlaps():
    assert exposed(1.0, 0.25, False) == pytest.approx(0.75)
    assert exposed(1.0, 0.25, True) == pytest.approx(0.75)  # long traffic: the same
    assert exposed(0.2, 0.25, False) == 0.0
    assert exposed(0.2, 0.25, True) == pytest.approx(0.1)  # half the backward's speed
    assert exposed(0.6, 0.25, True) == pytest.approx(0.35)


def test_which_strategies_spin():
    cfg = load(TINY, ["topology.dp=2", "optim.overlap=true"])
    assert buckets.OverlappedBuckets.spins(cfg, "thread")
    assert not buckets.OverlappedBuckets.spins(cfg, "poll")
    assert not buckets.OverlappedBuckets.spins(cfg, "test")
    assert buckets.OverlappedHierarchical.spins(cfg, "test")
    assert not buckets.BlockingBuckets.spins(cfg, "thread")


@pytest.mark.parametrize("crosses,want", [(True, ("test", True)), (False, ("test", False))])
def test_the_planner_overlaps_where_a_run_does(crosses, want):
    """``optim.overlap_across_nodes`` (on by default) overlaps a flat bucketed reduction
    whose dp groups cross nodes: the plan prices that run, hooks and posts included."""
    cfg = load(TINY, ['model.dtype="float32"', "topology.dp=4"])
    assert decided(cfg, crosses) == want
    c = dataclasses.replace(NODES, ranks_per_node=2 if crosses else 4, hook_overhead_s=1e-4)
    p = predict(cfg, c)
    assert (p.links["dp"] == "inter") is crosses
    assert (p.parts["hooks"] > 0) is crosses
    off = load(TINY, ['model.dtype="float32"', "topology.dp=4",
                      "optim.overlap_across_nodes=false"])
    assert not strategy_of(off).overlapped(off)
    if crosses:
        assert predict(off, c).parts["hooks"] == 0


def test_a_flat_all_reduce_on_a_shared_link_costs_the_bytes_that_leave_a_node():
    """2 nodes x 2 ranks, one port: each node sends the message once (what Open MPI's flat
    all-reduce was measured to send, benchmarks.crossing), as the hierarchical one's
    crossing does, not the 1.5x a rank's ring share; with a port per rank: the ring's."""
    n, link = 1e7, Link(0.0, 2.5e7, ports=1)
    assert allreduce(n, 4, link, "ring", 2) == pytest.approx(n / link.bandwidth)
    hier = allreduce(n, 4, link, "hierarchical", 2, NODES.intra) - 2 * scatter(n, 2, NODES.intra)
    assert allreduce(n, 4, link, "ring", 2) == pytest.approx(hier)
    assert allreduce(n, 8, link, "ring", 2) == pytest.approx(1.5 * n / link.bandwidth)
    assert allreduce(n, 4, Link(0.0, 2.5e7, ports=2), "ring", 2) == pytest.approx(
        n / 2 / link.bandwidth)
    assert allreduce(n, 4, Link(0.0, 2.5e7), "ring", 2) == pytest.approx(1.5 * n / 2.5e7)


def test_the_benchmark_limit_uses_the_measured_node_rate():
    from benchmarks.nodes import node_rate

    assert node_rate(None)[0] == pytest.approx(25e6) and "nominal" in node_rate(None)[1]
    rate, what = node_rate(dumps(NODES))
    assert rate == pytest.approx(2.5e7) and "measured" in what
    own = dataclasses.replace(NODES, inter=dataclasses.replace(NODES.inter, ports=0))
    assert node_rate(dumps(own))[0] == pytest.approx(2 * 2.5e7)  # a port per rank


def test_a_missed_peer_target_says_what_it_asks_of_the_limit():
    """A peer at 1.04x the limit leaves a 1.3x target 0.80x it: not reachable; at 1.40x,
    1.08x: reachable."""
    from benchmarks.nodes import headroom, peer_ratios

    assert "0.80x it (faster than the limit" in headroom("p", 1.04, 1.0, ">= 1.3")
    assert "1.08x it" in headroom("p", 1.40, 1.0, ">= 1.3")
    assert "not reachable" not in headroom("p", 1.40, 1.0, ">= 1.3")
    per = {"hpctrain a, bf16": [1.0, 1.0], "DDP x, bf16": [1.1, 1.1], "compute": [0.2, 0.2]}
    step = {k: v[0] for k, v in per.items()}
    [q] = peer_ratios(per, step, {}, {"float32": 2.0, "bf16": 0.9})
    assert not q["met"] and "runs at 1.22x the limit (900 ms)" in q["why"]
    [q] = peer_ratios(per, step, {})
    assert "the limit" not in q["why"]
