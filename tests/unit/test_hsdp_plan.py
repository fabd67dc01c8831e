"""HSDP (``topology.shard_within``) without MPI: the refusals of the config's rules, the
planner's price (the gathers on the shard group's link, one all-reduce of the shards across
groups, state divided by the shard size only) and ``plan --search`` choosing it where the
inter-node link is slow. Equivalence with one rank: tests/e2e/test_hsdp.py."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from launch import TINY

from hpctrain.checks.rules import problems
from hpctrain.config import load
from hpctrain.planner import search
from hpctrain.planner.cluster import from_dict as cluster_from_dict
from hpctrain.planner.cost import predict
from hpctrain.planner.hsdp import across, on_cluster
from hpctrain.planner.memory import estimate


def _problems(world: int, *sets: str) -> list[str]:
    return problems(load(TINY, list(sets)), world)


@pytest.mark.parametrize("world,sets,why", [
    (4, ("topology.dp=4", 'topology.shard_within="2"'), "it needs optim.zero = 1, 2 or 3"),
    (4, ("topology.dp=4", 'topology.shard_within="3"', "optim.zero=3"),
     "topology.shard_within=3 must divide dp*cp = 4*1 = 4"),
    (4, ("topology.dp=4", 'topology.shard_within="half"', "optim.zero=1"),
     'must be "", "node" or a shard group size such as "2"'),
    (4, ("topology.dp=4", 'topology.shard_within="0"', "optim.zero=1"), 'such as "2"'),
    (6, ("topology.dp=6", "topology.ep=2", "model.num_experts=2", "train.global_batch_size=12",
         'topology.shard_within="3"', "optim.zero=2"),
     "topology.shard_within=3 cuts the expert replicas unevenly (ep=2, cp=1); choose a "
     "multiple of ep*cp = 2 or a divisor of cp = 1"),
])
def test_refusals_name_the_key_and_the_fix(world, sets, why):
    found = _problems(world, *sets)
    assert len(found) == 1 and why in found[0], found


@pytest.mark.parametrize("world,sets", [
    (4, ("topology.dp=4", 'topology.shard_within="2"', "optim.zero=3")),
    (4, ("topology.dp=4", "topology.shard_within=node", "optim.zero=1")),
    (8, ("topology.dp=2", "topology.cp=2", "topology.tp=2", "topology.ep=2",
         "model.num_experts=4", 'topology.shard_within="2"', "optim.zero=2")),
    (4, ("topology.dp=2", "topology.cp=2", 'topology.shard_within="1"', "optim.zero=1")),
])
def test_layouts_that_shard_evenly_are_accepted(world, sets):
    assert _problems(world, *sets) == []


SLOW = cluster_from_dict({
    "name": "slow-link", "ranks_per_node": 4, "memory": 2**40, "efficiency": 0.5,
    "peak_flops": {"float32": 1e12, "float64": 5e11},
    "link": {"intra": {"latency": 1e-6, "bandwidth": 1e11},
             "inter": {"latency": 1e-4, "bandwidth": 1e8}}})


def test_node_is_the_dp_ranks_of_a_node():
    cfg = load(TINY, ["topology.dp=8", "topology.tp=2", "topology.shard_within=node",
                      "optim.zero=3"])
    assert on_cluster(cfg, SLOW).topology.shard_within == "2"  # 4 ranks per node / tp 2
    odd = load(TINY, ["topology.dp=6", "topology.shard_within=node", "optim.zero=3",
                      "train.global_batch_size=12"])
    with pytest.raises(ValueError, match="holds 4 of the dp\\*cp = 6 replicas"):
        on_cluster(odd, SLOW)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_plan_prices_hsdp_on_each_link(zero):
    """dp=8 on 2 nodes of 4: flat ZeRO runs its collectives over the slow link, HSDP keeps
    them inside a node and sends a quarter of the gradient across, once per step."""
    sets = ["topology.dp=8", f"optim.zero={zero}"]
    flat = predict(load(TINY, sets), SLOW)
    hsdp = predict(load(TINY, [*sets, "topology.shard_within=node"]), SLOW)
    assert hsdp.step_s < flat.step_s / 3, (hsdp.parts, flat.parts)
    assert hsdp.parts["dp"] > 0 and hsdp.links["dp"] == "inter"  # the cross-node all-reduce
    if zero == 3:
        assert (hsdp.links["zero3"], flat.links["zero3"]) == ("intra", "inter")
        assert hsdp.parts["zero3"] < flat.parts["zero3"] / 10
    assert hsdp.memory.optimizer == 2 * flat.memory.optimizer  # shards of 4, not of 8
    sized = [*sets, 'topology.shard_within="4"', "model.dtype=float32"]
    f32 = across(load(TINY, sized), SLOW, SLOW.inter, P=10**9, calls=1)
    wire = across(load(TINY, [*sized, 'optim.grad_comm_dtype="bfloat16"']), SLOW, SLOW.inter,
                  P=10**9, calls=1)
    assert wire == pytest.approx(f32 / 2, rel=0.01)  # the cross-node shards in 16 bits


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(2, 1), (4, 1), (4, 2), (2, 2), (8, 1), (8, 2)]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]))
def test_memory_is_divided_by_the_shard_size_only(dpcp, s, zero):
    """HSDP over dp x cp with shard groups of s holds what plain ZeRO over s replicas holds."""
    dp, cp = dpcp
    if (dp * cp) % s:
        return
    base = load(TINY, [f"optim.zero={zero}", f"topology.cp={cp}"])
    t = base.topology
    hsdp = dataclasses.replace(base, topology=dataclasses.replace(t, dp=dp,
                                                                  shard_within=str(s)))
    plain = dataclasses.replace(base, topology=dataclasses.replace(t, dp=s // cp or 1,
                                                                   cp=cp if s >= cp else s))
    a, b = estimate(hsdp), estimate(plain)
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)


def test_search_chooses_hsdp_where_the_inter_node_link_is_slow():
    """One layer and one head leave dp alone (no tp, no pp): on 2 nodes of 4 ranks the best
    layout shards within a node and reduces across nodes once."""
    cfg = load(TINY, ["model.n_layers=1", "model.n_heads=1", "model.n_kv_heads=1",
                      'model.dtype="float32"'])
    cands = search.search(cfg, SLOW, 2, max_cp=1)
    best = cands[0]
    assert best.cfg.topology.shard_within == "4" and best.cfg.optim.zero > 0, best.label()
    assert 'topology.shard_within="4"' in best.sets and "shard=4" in best.label()
    flat = [c for c in cands if c.prediction and not c.cfg.topology.shard_within]
    assert best.prediction.step_s < min(c.prediction.step_s for c in flat) / 3


def test_plan_with_a_cluster_shows_the_memory_of_a_node_sized_shard(capsys):
    """`plan --cluster` resolves shard_within="node" before every section: the memory lines
    are those of shard groups of a node's 4 ranks, not of all 8."""
    from hpctrain.__main__ import main

    def section(within: str) -> str:
        assert main(["plan", str(TINY), "--set", "topology.dp=8", "--set", "optim.zero=3",
                     "--set", f"topology.shard_within={within}", "--cluster", "dgx-h100",
                     "--ranks-per-node", "4"]) == 0
        out = capsys.readouterr().out
        return out[out.index("memory per rank"):out.index("communication per rank")]

    assert section('"node"') == section('"4"') != section('""')
