"""Hybrid context parallelism without MPI: the factoring ``config.cp_factors`` (cp = Ulysses
degree x ring degree), and what ``plan`` makes of the three kinds: the hybrid's price is
its all-to-alls over a Ulysses group plus rings over the groups, ``--search`` tries every
Ulysses degree the heads allow and picks the hybrid where the cp ranks span nodes, and the
memory estimate tells the kinds apart (what each attention saves)."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_ulysses_plan import _cluster as ulysses_cluster

from hpctrain.config import TopologyConfig, cp_factors, load
from hpctrain.planner import search
from hpctrain.planner.cluster import Link
from hpctrain.planner.collectives import context_exposed, ring_exposed, ulysses_exposed
from hpctrain.planner.cost import axis_links, predict
from hpctrain.planner.memory import block_activation_bytes, comm_volume

LLAMA = str(Path(__file__).resolve().parents[2] / "share/configs/tiny-llama.toml")
CP4 = ["train.seq_len=4096", "train.global_batch_size=4", "topology.cp=4"]


@given(cp=st.sampled_from([1, 2, 4, 8, 16]), tp=st.sampled_from([1, 2, 4]),
       per_tp=st.integers(1, 16), groups=st.sampled_from([1, 2, 4]),
       node=st.sampled_from([0, 2, 4, 8, 12]))
def test_default_ulysses_degree_is_the_largest_the_heads_and_the_node_allow(
        cp, tp, per_tp, groups, node):
    kv = per_tp * tp
    heads = kv * groups
    u, r = cp_factors(TopologyConfig(cp=cp, tp=tp), heads, kv, node)
    assert u * r == cp

    def allowed(d):
        return (cp % d == 0 and heads // tp % d == 0 and kv // tp % d == 0
                and (not node or node % (tp * d) == 0))
    assert u == 1 or allowed(u)
    assert not any(allowed(d) for d in range(u + 1, cp + 1))


@pytest.mark.parametrize("u", [1, 2, 4])
def test_the_key_sets_the_ulysses_degree(u):
    assert cp_factors(TopologyConfig(cp=4, cp_kind="hybrid", cp_ulysses=u), 1, 1, 3) == \
        (u, 4 // u)


def _cluster(**over):
    """test_ulysses_plan's cluster with 2 ranks per node and a slower link between nodes."""
    return ulysses_cluster(ranks_per_node=2, inter=Link(latency=1e-4, bandwidth=1e8), **over)


def test_hybrid_price_is_the_all_to_alls_inside_plus_the_ring_across():
    # 2 ranks per node, cp=4: Ulysses groups of 2 on the node's link, rings of 2 across
    cluster = _cluster(ring_overhead_s=1e-4)
    cfg = load(LLAMA, [*CP4, "topology.cp_kind=hybrid"])
    links, rate = axis_links(cfg, cluster), 1e11
    f, b = context_exposed(cfg, cluster, links, rate, 1.0)
    a2a = ulysses_exposed(cfg, cluster, cluster.intra, 2)
    ring_f, ring_b = ring_exposed(cfg, cluster, cluster.inter, rate, 2, 2)
    assert links["cp"] is cluster.inter and ring_f > 0
    assert (f, b) == pytest.approx((a2a + ring_f + 1e-4, a2a + ring_b + 2e-4))


def test_search_picks_the_hybrid_when_cp_spans_nodes():
    # Ulysses over 4 ranks sends its all-to-alls across the slow link; the ring of 4 passes
    # 3 key/value blocks per pass; the hybrid keeps its all-to-alls on the node and rings
    # over 2 ranks with longer blocks to hide behind.
    cluster = _cluster()
    cp = {k: predict(load(LLAMA, [*CP4, f"topology.cp_kind={k}"]), cluster).parts["cp"]
          for k in ("ring", "ulysses", "hybrid")}
    assert cp["hybrid"] < min(cp["ring"], cp["ulysses"]), cp
    found = [c for c in search.search(load(LLAMA, CP4[:2]), cluster, 2, max_tp=1)
             if c.prediction and c.cfg.topology.cp == 4]
    assert found[0].cfg.topology.cp_kind == "hybrid", found[0].label()
    assert "topology.cp_ulysses=2" in found[0].sets and "hybrid 2x2" in found[0].label()
    assert {c.cfg.topology.cp_kind for c in found} == {"ring", "ulysses", "hybrid"}


def test_plan_memory_and_bytes_tell_the_kinds_apart():
    # tiny-llama: 8 query heads on 4 kv heads. Per token, the ring saves the layer input,
    # q, k and v (kv heads) and one output; the hybrid 2x2 a second output (the ring's,
    # before the all-to-all back); Ulysses k and v repeated to the query heads too.
    def cfg(kind, *more):
        return load(LLAMA, ["topology.cp=4", f"topology.cp_kind={kind}", *more])
    mem = {k: block_activation_bytes(cfg(k)) for k in ("ring", "ulysses")}
    mem["hybrid"] = block_activation_bytes(cfg("hybrid", "topology.cp_ulysses=2"))
    assert mem["ring"] < mem["hybrid"] < mem["ulysses"], mem
    # the hybrid with one ring (u = cp, the default here) runs Ulysses' attention
    assert block_activation_bytes(cfg("hybrid")) == mem["ulysses"]
    m, T = cfg("ring").model, cfg("ring").train.seq_len // 4  # float64; T/cp tokens
    C, kv = m.d_model, 2 * 4 * m.head_dim
    assert mem["hybrid"] - mem["ring"] == T * C * 8
    assert mem["ulysses"] - mem["ring"] == T * (3 * C - kv) * 8
    # bytes: the hybrid 2x2 sends half its q, k, v, o over its Ulysses pair, both passes,
    # and passes kv blocks of half the heads over twice the tokens around a ring of 2
    one = comm_volume(cfg("ring"), 1000, 8, 1)["cp"] // (3 * 4 - 2)  # a kv block, per layer
    both = comm_volume(cfg("hybrid", "topology.cp_ulysses=2"), 1000, 8, 1)["cp"]
    qkvo = one // 2 * (2 * m.n_heads + 2 * 4) // 4  # q, k, v, o of this rank's tokens
    assert both == int(one * (3 * 2 - 2) + 2 * qkvo / 2)
