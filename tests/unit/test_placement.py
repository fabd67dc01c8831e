"""``topology.crossing`` (what ``hpctrain plan --nodes`` prints), no MPI."""

import pytest

from hpctrain.checks.validate import validate
from hpctrain.cli.plan import plan_section
from hpctrain.config import ConfigError, TopologyConfig, load
from hpctrain.topology import crossing


def test_auto_keeps_tp_inside_nodes_and_naive_does_not():
    auto = crossing(TopologyConfig(dp=2, tp=2), nodes=2, ranks_per_node=2)
    assert auto["tp"] == (0, 2) and auto["dp"] == (2, 2)
    naive = crossing(TopologyConfig(dp=2, tp=2), 2, 2, placement="naive")
    assert naive["tp"] == (2, 2) and naive["dp"] == (0, 2)


def test_tp_wider_than_a_node_crosses():
    c = crossing(TopologyConfig(dp=2, tp=4), nodes=4, ranks_per_node=2)
    assert c["tp"] == (2, 2)
    c = crossing(TopologyConfig(dp=4, tp=2, ep=2), nodes=2, ranks_per_node=4)
    assert c["tp"][0] == 0 and c["ep"][0] == 0 and c["dp"][0] == 2


def test_plan_section_and_bad_counts():
    cfg = load(None, ["topology.dp=2", "topology.tp=2", "experimental.placement=naive"])
    text = "\n".join(plan_section(cfg, 2, 2))
    assert "tp=2: CROSSES the inter-node link" in text and "dp=2: inside a node" in text
    with pytest.raises(ValueError, match="3 ranks, the layout has 4"):
        crossing(cfg.topology, 3, 1)


def test_hierarchical_rejects_zero_and_overlap():
    cfg = load(None, ["topology.dp=2", "topology.dp_reduction=hierarchical", "optim.zero=1"])
    with pytest.raises(ConfigError, match="dp_reduction=hierarchical needs"):
        validate(cfg, 2)
