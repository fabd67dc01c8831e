"""HSDP through the real CLI: a shard size that does not divide dp x cp is refused, and on
two simulated nodes ``shard_within = "node"`` shards within each node and equals one rank
(float64, 1e-9). The layouts against one rank run in tests/matrix/test_hsdp_layouts.py."""

import pytest
from launch import (
    TINY,
    assert_about_one_dp,
    assert_same,
    assert_sharded_and_replicated,
    baseline,
    hpctrain,
    train_cli,
)
from test_cluster import cluster  # noqa: F401 (the simulated 2-node cluster)

pytestmark = pytest.mark.e2e


def test_shard_size_that_does_not_divide_is_refused(tmp_path):
    proc = hpctrain(["train", TINY, "--run-dir", str(tmp_path / "run"), "--set",
                     'topology.shard_within="3"', "--set", "optim.zero=3"], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "topology.shard_within=3 must divide dp*cp = 1*1 = 1" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.netns
def test_shard_within_node_on_two_nodes(cluster, tmp_path, session_dir):  # noqa: F811
    """dp=4 on 2 nodes x 2 ranks: the shard groups are the nodes, the replicas cross the
    link; the one-rank run's model (1e-9)."""
    ref = baseline(session_dir)
    run = train_cli(tmp_path / "node", 4, "topology.dp=4", "topology.shard_within=node",
                    "optim.zero=3", launcher=cluster)
    assert_same(run, ref, rel=1e-9, what="hsdp dp4 shard_within=node on 2 nodes")
    assert_about_one_dp(run, ref, 2, "shard_within=node: 2 ranks per node")
    assert_sharded_and_replicated(run)
