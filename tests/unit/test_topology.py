"""Rank <-> grid coordinates without MPI."""

import itertools

import pytest

from hpctrain.config import TopologyConfig
from hpctrain.topology import Coords, coords_to_rank, grid_dims, naive_order, rank_to_coords

SHAPES = [(1, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 1, 1, 2), (2, 1, 1, 1, 2), (2, 2, 1, 1, 2),
          (1, 1, 2, 1, 4), (2, 1, 2, 1, 2), (8, 1, 1, 1, 1), (3, 1, 1, 1, 1), (1, 3, 1, 1, 5),
          (2, 3, 1, 1, 1), (3, 1, 3, 1, 1), (1, 1, 1, 2, 1), (2, 1, 1, 2, 2), (1, 2, 2, 4, 2)]


@pytest.mark.parametrize("dims", SHAPES)
def test_bijection_and_tp_fastest(dims):
    n = dims[0] * dims[1] * dims[2] * dims[3] * dims[4]
    seen = set()
    for r in range(n):
        c = rank_to_coords(r, dims)
        assert coords_to_rank(c, dims) == r
        seen.add((c.pp, c.dp_outer, c.ep, c.cp, c.tp))
    assert len(seen) == n
    # tp varies fastest: consecutive ranks form a tensor-parallel group; cp comes next.
    tp, cp = dims[4], dims[3]
    for start in range(0, n, tp):
        group = [rank_to_coords(r, dims) for r in range(start, start + tp)]
        assert [g.tp for g in group] == list(range(tp))
        assert len({(g.pp, g.dp_outer, g.ep, g.cp) for g in group}) == 1
    for start in range(0, n, tp * cp):
        ring = [rank_to_coords(r, dims) for r in range(start, start + tp * cp, tp)]
        assert [g.cp for g in ring] == list(range(cp))
        assert len({(g.pp, g.dp_outer, g.ep, g.tp) for g in ring}) == 1


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_all_layouts_of_world(world):
    for dp, tp, pp in itertools.product([1, 2, 4, 8], repeat=3):
        if dp * tp * pp != world:
            continue
        dims = grid_dims(TopologyConfig(dp=dp, tp=tp, pp=pp))
        assert dims == (pp, dp, 1, 1, tp)
        assert sorted(coords_to_rank(rank_to_coords(r, dims), dims)
                      for r in range(world)) == list(range(world))


def test_ep_carved_out_of_dp():
    assert grid_dims(TopologyConfig(dp=4, ep=2)) == (1, 2, 2, 1, 1)
    assert rank_to_coords(3, (1, 2, 2, 1, 1)) == Coords(0, 1, 1, 0, 0)
    assert grid_dims(TopologyConfig(dp=2, cp=2, tp=2)) == (1, 2, 1, 2, 2)
    assert rank_to_coords(6, (1, 2, 1, 2, 2)) == Coords(0, 1, 0, 1, 0)


def test_out_of_range():
    with pytest.raises(ValueError):
        rank_to_coords(4, (1, 2, 1, 1, 2))
    with pytest.raises(ValueError):
        coords_to_rank(Coords(0, 2, 0, 0, 0), (1, 2, 1, 1, 2))


def test_naive_placement_is_a_permutation_with_tp_strided():
    dims = (1, 2, 1, 1, 2)
    order = naive_order(4, dims)
    assert sorted(order) == [0, 1, 2, 3]
    # world ranks 0 and 1 (one node of two) hold different dp coords, same tp coord.
    a, b = rank_to_coords(order[0], dims), rank_to_coords(order[1], dims)
    assert a.tp == b.tp and a.dp_outer != b.dp_outer
