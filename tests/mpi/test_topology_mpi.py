"""Cartesian sub-communicators at every layout the world size allows."""

import itertools

import pytest
import torch

from hpctrain import comm
from hpctrain.config import TopologyConfig
from hpctrain.topology import Topology, context_groups, rank_to_coords

pytestmark = pytest.mark.mpi


def layouts(n):
    for dp, tp, pp, cp in itertools.product([1, 2, 4], repeat=4):
        if dp * tp * pp * cp == n:
            for ep in (1, 2):
                if dp % ep == 0:
                    yield TopologyConfig(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)


def test_subcommunicators_match_coordinates():
    world = comm.world()
    for cfg in layouts(world.size):
        topo = Topology(cfg, world)
        c = rank_to_coords(world.rank, topo.dims)
        assert topo.coords == c
        assert topo.tp_size == cfg.tp and topo.pp_size == cfg.pp and topo.dp_size == cfg.dp
        assert topo.ep_size == cfg.ep and topo.edp_comm.size == cfg.dp // cfg.ep
        assert topo.tp_rank == c.tp and topo.pp_rank == c.pp and topo.ep_rank == c.ep
        assert topo.dp_rank == c.dp_outer * cfg.ep + c.ep
        assert topo.cp_size == cfg.cp and topo.cp_rank == c.cp
        assert topo.dpcp_comm.size == cfg.dp * cfg.cp
        assert topo.edpcp_comm.size == cfg.dp // cfg.ep * cfg.cp
        # Every member of my tp group shares my (pp, dp_outer, ep, cp): gather and compare.
        for group, same in ((topo.tp_comm, ("pp", "dp_outer", "ep", "cp")),
                            (topo.dp_comm, ("pp", "cp", "tp")),
                            (topo.pp_comm, ("dp_outer", "ep", "cp", "tp")),
                            (topo.ep_comm, ("pp", "dp_outer", "cp", "tp")),
                            (topo.cp_comm, ("pp", "dp_outer", "ep", "tp")),
                            (topo.dpcp_comm, ("pp", "tp")),
                            (topo.edpcp_comm, ("pp", "ep", "tp"))):
            coords = group.allgather_obj(topo.coords)
            for other in coords:
                assert all(getattr(other, a) == getattr(c, a) for a in same), (group, coords)
        # Pipeline neighbours: PROC_NULL at the ends.
        if topo.pp_rank == 0:
            assert topo.pp_prev == comm.PROC_NULL
        else:
            assert topo.pp_prev == topo.pp_rank - 1
        if topo.pp_rank == cfg.pp - 1:
            assert topo.pp_next == comm.PROC_NULL
        else:
            assert topo.pp_next == topo.pp_rank + 1
        # A reduction over one axis sums exactly that axis's members.
        assert topo.tp_comm.allreduce(1.0) == cfg.tp
        t = torch.ones(1)
        topo.dp_comm.allreduce_(t)
        assert t.item() == cfg.dp


def test_node_local_rank():
    topo = Topology(TopologyConfig(dp=comm.world().size), comm.world())
    assert 0 <= topo.local_rank < topo.node_comm.size <= topo.world_size
    assert topo.hostname


def test_naive_placement_permutes_grid():
    world = comm.world()
    if world.size < 4:
        pytest.skip("naive placement differs from auto only with tp and dp > 1")
    topo = Topology(TopologyConfig(dp=world.size // 2, tp=2), world, placement="naive")
    # Ranks 0 and 1 of the world are no longer one tp group.
    tp_coords = world.allgather_obj(topo.coords.tp)
    assert tp_coords[0] == tp_coords[1]


def test_hybrid_context_groups():
    """``topology.context_groups``: cp_comm cut into Ulysses groups of u consecutive cp
    ranks and rings of the ranks at the same place of each group, at every layout and u."""
    world = comm.world()
    for cfg in (c for c in layouts(world.size) if c.cp > 1 and c.ep == 1):
        topo = Topology(cfg, world)
        for u in (d for d in (1, 2, 4) if cfg.cp % d == 0):
            ulysses, ring = context_groups(topo, u)
            assert (ulysses.size, ring.size) == (u, cfg.cp // u)
            assert (ulysses.rank, ring.rank) == (topo.cp_rank % u, topo.cp_rank // u)
            first = topo.cp_rank // u * u
            assert ulysses.allgather_obj(topo.cp_rank) == list(range(first, first + u))
            assert ring.allgather_obj(topo.cp_rank) == list(range(topo.cp_rank % u, cfg.cp, u))
            assert ring.allgather_obj(topo.coords.tp) == [topo.coords.tp] * ring.size
        assert 1 <= topo.node_ranks() <= world.size
