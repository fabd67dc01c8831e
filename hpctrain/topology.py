"""Topology: the Cartesian rank grid and one sub-communicator per parallel axis.

The grid dims are ``(pp, dp_outer, ep, tp)`` with ``dp = dp_outer * ep`` and ``tp`` varying
fastest, so consecutive world ranks form a tensor-parallel group (which therefore sits inside
one node when ranks are packed by node, as ``srun`` and ``mpirun`` do by default).

``grid_dims``/``rank_to_coords``/``coords_to_rank`` are pure functions (no MPI) so that the
mapping can be tested, planned and printed without a launcher. :class:`Topology` is created
once per process and passed explicitly to every component.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import TopologyConfig

AXES = ("pp", "dp_outer", "ep", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp_outer: int
    ep: int
    tp: int

    def __str__(self) -> str:
        return f"(pp={self.pp}, dp={self.dp_outer}, ep={self.ep}, tp={self.tp})"


def grid_dims(tcfg: TopologyConfig) -> tuple[int, int, int, int]:
    """(pp, dp_outer, ep, tp) for a topology config."""
    return (tcfg.pp, tcfg.dp // tcfg.ep, tcfg.ep, tcfg.tp)


def rank_to_coords(rank: int, dims: tuple[int, ...]) -> Coords:
    """Row-major (C order) mapping, the order ``MPI_Cart_create`` uses with reorder=False."""
    size = 1
    for d in dims:
        size *= d
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a grid of {size} ranks {dims}")
    out = []
    for d in reversed(dims):
        out.append(rank % d)
        rank //= d
    return Coords(*reversed(out))


def coords_to_rank(c: Coords, dims: tuple[int, ...]) -> int:
    rank = 0
    for value, d in zip((c.pp, c.dp_outer, c.ep, c.tp), dims):
        if not 0 <= value < d:
            raise ValueError(f"coordinate {value} outside dimension of size {d}")
        rank = rank * d + value
    return rank


def naive_order(world_size: int, dims: tuple[int, ...]) -> list[int]:
    """A placement that puts tp *last-varying* (tp groups strided across nodes): the grid
    position of world rank r for ``topology.placement = "naive"``. Only for comparisons."""
    pp, dpo, ep, tp = dims
    order = []
    for t in range(tp):
        for p in range(pp):
            for d in range(dpo):
                for e in range(ep):
                    order.append(coords_to_rank(Coords(p, d, e, t), dims))
    return order


class Topology:
    """This process's place in the grid and the communicators of each axis.

    Attributes (``comm.Group`` objects, each collective over its axis only):
      ``world``, ``tp_comm``, ``pp_comm``, ``dp_comm`` (dp_outer x ep: dense gradients),
      ``ep_comm`` (token all-to-all), ``edp_comm`` (dp_outer: expert gradients),
      ``node_comm`` (ranks sharing memory with this one).
    ``pp_prev``/``pp_next`` are ranks in ``pp_comm`` (``MPI.PROC_NULL`` at the ends).
    Creating a Topology is collective over the world communicator.
    """

    def __init__(self, tcfg: TopologyConfig, world=None):
        from . import comm

        self.cfg = tcfg
        self.dims = grid_dims(tcfg)
        self.world = world if world is not None else comm.world()
        n = self.dims[0] * self.dims[1] * self.dims[2] * self.dims[3]
        if n != self.world.size:
            raise ValueError(f"grid {self.dims} has {n} ranks, world has {self.world.size}")
        from . import placement

        # naive: tp strided across nodes (comparisons); auto: ranks packed by node first.
        if tcfg.placement == "naive":
            key = naive_order(n, self.dims)[self.world.rank]
        else:
            key = placement.packed_key(self.world)
        self.cart = comm.cartesian(self.world, self.dims, key)
        self.rank = self.cart.rank
        self.coords = rank_to_coords(self.rank, self.dims)
        self.pp_comm = comm.sub(self.cart, (True, False, False, False), "pp")
        self.dp_comm = comm.sub(self.cart, (False, True, True, False), "dp")
        self.ep_comm = comm.sub(self.cart, (False, False, True, False), "ep")
        self.edp_comm = comm.sub(self.cart, (False, True, False, False), "edp")
        self.tp_comm = comm.sub(self.cart, (False, False, False, True), "tp")
        self.pp_prev, self.pp_next = comm.shift(self.cart, 0)
        self.node_comm = comm.node_local(self.cart)
        self.within_node = placement.check(self)  # axis -> every group inside one node
        self.dp_levels = placement.dp_levels(self)  # hierarchical dp reduction, or None
        self.hostname = comm.processor_name()

    # Sizes and ranks per axis, in the vocabulary of DESIGN.md.
    @property
    def world_size(self) -> int:
        return self.cart.size

    @property
    def dp_size(self) -> int:
        return self.dp_comm.size

    @property
    def dp_rank(self) -> int:
        return self.dp_comm.rank

    @property
    def tp_size(self) -> int:
        return self.tp_comm.size

    @property
    def tp_rank(self) -> int:
        return self.tp_comm.rank

    @property
    def pp_size(self) -> int:
        return self.pp_comm.size

    @property
    def pp_rank(self) -> int:
        return self.pp_comm.rank

    @property
    def ep_size(self) -> int:
        return self.ep_comm.size

    @property
    def ep_rank(self) -> int:
        return self.ep_comm.rank

    @property
    def local_rank(self) -> int:
        return self.node_comm.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """One line naming this rank, its grid coordinates and its node."""
        return f"rank {self.rank} {self.coords} on {self.hostname}"
