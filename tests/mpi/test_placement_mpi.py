"""Hierarchical dp reduction equals the flat all-reduce (float64, rel <= 1e-12) and placement
checks, at any world size. Nodes are pretended by colour (rank // k) so that both levels of
the hierarchy carry traffic on one machine; tests/e2e/test_cluster.py does it on real
network namespaces."""

import pytest
import torch

from hpctrain import comm
from hpctrain.config import TopologyConfig
from hpctrain.parallel.grad_sync.buckets import build_hierarchy, levels, reduce_hierarchical
from hpctrain.topology import Topology

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 1000])  # 7 and 1000: not multiples of ranks per node
def test_hierarchical_equals_flat(per_node, n):
    world = comm.world()
    if world.size % per_node:
        pytest.skip(f"world of {world.size} ranks is not whole nodes of {per_node}")
    h = build_hierarchy(world, node_color=world.rank // per_node)
    assert h.uniform and h.local.size == per_node
    assert h.cross.size == world.size // per_node
    g = torch.Generator().manual_seed(10 + world.rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    flat, hier = x.clone(), x.clone()
    world.allreduce_(flat)
    reduce_hierarchical(h, hier)
    err = float((hier - flat).abs().max() / flat.abs().max())
    assert err <= 1e-12, err
    # The reference sum, computed independently of both collectives.
    every = world.allgather_obj(x.numpy())
    assert torch.allclose(hier, torch.tensor(sum(every)), rtol=1e-12, atol=0)


@pytest.mark.mpi(min_size=3)  # nodes of unequal size
def test_nonuniform_nodes_fall_back_to_flat():
    world = comm.world()
    h = build_hierarchy(world, node_color=int(world.rank == 0))
    assert not h.uniform
    x = torch.full((5,), float(world.rank + 1), dtype=torch.float64)
    reduce_hierarchical(h, x)
    assert torch.all(x == world.size * (world.size + 1) / 2)


def test_auto_placement_keeps_tp_inside_the_node():
    world = comm.world()
    if world.size % 2:
        pytest.skip("tp=2 needs an even world")
    topo = Topology(TopologyConfig(dp=world.size // 2, tp=2), world)
    # One machine is one node: every axis is inside it, and the levels exist only on demand.
    assert topo.within_node == {"tp": True, "cp": True, "ep": True, "dp": True, "pp": True}
    assert levels(topo) is None
    topo = Topology(TopologyConfig(dp=world.size, dp_reduction="hierarchical"), world)
    assert levels(topo)["dp"].local.size == world.size  # one node: local = whole group
