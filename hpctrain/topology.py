"""Topology: the Cartesian rank grid and one sub-communicator per parallel axis.

The grid dims are ``(pp, dp_outer, ep, cp, tp)`` with ``dp = dp_outer * ep``, ``tp`` varying
fastest and context parallelism (``cp``) next, so consecutive world ranks form a
tensor-parallel group (which therefore sits inside one node when ranks are packed by node, as
``srun`` and ``mpirun`` do by default) and a cp ring is the next tier out.

**Placement** (``experimental.placement``, given to :class:`Topology` and :func:`crossing`;
default ``auto``): a node is the set of ranks that share memory.
``auto`` renumbers the world so that ranks are packed by node even when the launcher
interleaved them (``--map-by node``), so tp groups sit inside a node; :func:`check` verifies
that each tp (and ep, cp) group lies within one node and warns when it cannot. ``naive``
strides tp groups across nodes (:func:`naive_order`), for comparisons. :func:`crossing`
answers the same question without MPI for ``hpctrain plan --nodes N``.

``grid_dims``/``rank_to_coords``/``coords_to_rank``/``crossing`` are pure functions (no MPI)
so that the mapping can be tested, planned and printed without a launcher. A
:class:`Topology` is created once per run and passed explicitly to every component; it owns
the run's :class:`comm.Recorder`, to which all its groups report.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from . import comm
from .config import TopologyConfig

AXES = ("pp", "dp_outer", "ep", "cp", "tp")
# Which grid dims vary within one group of each axis (dims: pp, dp_outer, ep, cp, tp).
AXIS_DIMS = {"tp": (4,), "cp": (3,), "ep": (2,), "dp": (1, 2), "pp": (0,)}


@dataclass(frozen=True)
class Coords:
    pp: int
    dp_outer: int
    ep: int
    cp: int
    tp: int

    def __str__(self) -> str:
        cp = f", cp={self.cp}" if self.cp else ""
        return f"(pp={self.pp}, dp={self.dp_outer}, ep={self.ep}{cp}, tp={self.tp})"


def grid_dims(tcfg: TopologyConfig) -> tuple[int, int, int, int, int]:
    """(pp, dp_outer, ep, cp, tp) for a topology config."""
    return (tcfg.pp, tcfg.dp // tcfg.ep, tcfg.ep, tcfg.cp, tcfg.tp)


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
    for value, d in zip((c.pp, c.dp_outer, c.ep, c.cp, c.tp), dims):
        if not 0 <= value < d:
            raise ValueError(f"coordinate {value} outside dimension of size {d}")
        rank = rank * d + value
    return rank


def naive_order(world_size: int, dims: tuple[int, ...]) -> list[int]:
    """A placement that puts tp *last-varying* (tp groups strided across nodes): the grid
    position of world rank r for ``experimental.placement = "naive"``. Only for comparisons."""
    pp, dpo, ep, cp, tp = dims
    order = []
    for t in range(tp):
        for p in range(pp):
            for d in range(dpo):
                for e in range(ep):
                    for c in range(cp):
                        order.append(coords_to_rank(Coords(p, d, e, c, t), dims))
    return order


def packed_key(world: comm.Group) -> int:
    """This rank's position when world ranks are sorted by (node, world rank): the key that
    packs ranks by node. Equal to ``world.rank`` when the launcher packed them already.
    Collective over ``world``."""
    node = comm.node_local(world)
    leader = int(node.allreduce(float(world.rank), "min"))  # names the node
    pairs = sorted(world.allgather_obj((leader, world.rank)))
    return pairs.index((leader, world.rank))


def check(topo, warn=None) -> dict[str, bool]:
    """For each axis, whether every group of it lies within one node (False: it crosses the
    inter-node link). With ``placement = "auto"`` warns (world rank 0, or ``warn``) when tp
    or ep (or cp) groups cross nodes. Collective over the world and over each axis group."""
    groups = {"tp": topo.tp_comm, "cp": topo.cp_comm, "ep": topo.ep_comm, "dp": topo.dp_comm,
              "pp": topo.pp_comm}
    within = {}
    for axis, g in groups.items():
        local = comm.node_local(g, axis=f"{axis}-node")
        within[axis] = topo.world.allreduce(float(local.size == g.size), "min") == 1.0
    if topo.placement == "auto" and topo.world.rank == 0:
        for axis in ("tp", "ep", "cp"):
            if not within[axis] and groups[axis].size > 1:
                msg = (f"placement: {axis} groups (size {groups[axis].size}) cross nodes of "
                       f"{topo.node_comm.size} ranks; make ranks per node a multiple of "
                       f"{'tp*cp' if axis == 'cp' else axis} so they stay on the fast link")
                (warn or _stderr)(msg)
    return within


def _stderr(msg: str) -> None:
    print(f"[hpctrain] warning: {msg}", file=sys.stderr, flush=True)


def crossing(tcfg, nodes: int, ranks_per_node: int,
             placement: str = "auto") -> dict[str, tuple[int, int]]:
    """Without MPI: for each axis, (groups that span more than one node, groups), when
    ``nodes * ranks_per_node`` ranks are packed by node and placed as ``placement``."""
    dims = grid_dims(tcfg)
    n = dims[0] * dims[1] * dims[2] * dims[3] * dims[4]
    if nodes * ranks_per_node != n:
        raise ValueError(f"--nodes {nodes} x --ranks-per-node {ranks_per_node} = "
                         f"{nodes * ranks_per_node} ranks, the layout has {n}")
    key = naive_order(n, dims) if placement == "naive" else list(range(n))
    node_of = {key[w]: w // ranks_per_node for w in range(n)}  # grid rank -> node
    out = {}
    for axis, varying in AXIS_DIMS.items():
        groups: dict[tuple, set] = {}
        for g in range(n):
            c = rank_to_coords(g, dims)
            values = (c.pp, c.dp_outer, c.ep, c.cp, c.tp)
            fixed = tuple(v for i, v in enumerate(values) if i not in varying)
            groups.setdefault(fixed, set()).add(node_of[g])
        out[axis] = (sum(len(s) > 1 for s in groups.values()), len(groups))
    return out


def context_groups(topo, u: int) -> tuple[comm.Group, comm.Group]:
    """Hybrid context parallelism: ``cp_comm`` cut into (this rank's Ulysses group, its
    ring) for ``u`` ranks per Ulysses group (``config.cp_factors``: cp rank ``i`` is rank
    ``i % u`` of Ulysses group ``i // u`` and rank ``i // u`` of ring ``i % u``); both
    report as axis ``cp``. Collective over ``cp_comm``."""
    r = topo.cp_comm.rank
    return (comm.split(topo.cp_comm, r // u, r, "cp"), comm.split(topo.cp_comm, r % u, r, "cp"))


def shard_groups(topo) -> dict[str, tuple[comm.Group, comm.Group]]:
    """HSDP (``topology.shard_within``): each replica group (``dpcp_comm``, ``edpcp_comm``)
    cut into *shard groups* (its ranks on this node, or in this rank's block of N consecutive
    ``dpcp_comm`` ranks) and *replica groups* (its ranks at the same position of every shard
    group), keyed ``dp`` / ``edp`` as ``grad_sync.interface.group_key``. ValueError when the
    shard groups of one replica group differ in size (nodes holding unequal numbers of its
    ranks). Collective over the world."""
    w = topo.cfg.shard_within
    if w == "node":  # the node, named by its lowest grid rank
        color = int(topo.node_comm.allreduce(float(topo.rank), "min"))
    else:
        color = topo.dpcp_comm.rank // int(w)
    out = {}
    for key, g in (("dp", topo.dpcp_comm), ("edp", topo.edpcp_comm)):
        shard = comm.split(g, color, g.rank, f"{g.axis}-shard")
        replica = comm.split(g, shard.rank, g.rank, f"{g.axis}-replica")
        sizes = sorted(set(g.allgather_obj(shard.size)))
        if len(sizes) > 1:
            raise ValueError(f"topology.shard_within={w!r}: the {g.axis} groups hold "
                             f"{' or '.join(map(str, sizes))} ranks per shard group (nodes "
                             "with unequal rank counts); give a size that divides dp*cp")
        out[key] = (shard, replica)
    return out


class Topology:
    """This process's place in the grid and the communicators of each axis.

    Attributes (``comm.Group`` objects, each collective over its axis only):
      ``world``, ``tp_comm``, ``pp_comm``, ``dp_comm`` (dp_outer x ep: dense gradients),
      ``ep_comm`` (token all-to-all), ``edp_comm`` (dp_outer: expert gradients),
      ``cp_comm`` (the ring of context parallelism), ``node_comm`` (ranks sharing memory).
    The replicas of a parameter: ``dpcp_comm`` (dp x cp: dense gradients, their ZeRO shards,
    the checkpoint writers) and ``edpcp_comm`` (dp_outer x cp: experts); with cp = 1 they
    are ``dp_comm`` and ``edp_comm`` themselves.
    ``pp_prev``/``pp_next`` are ranks in ``pp_comm`` (``MPI.PROC_NULL`` at the ends).
    ``hsdp``: with ``topology.shard_within``, the (shard, replica) groups of ``dp`` and
    ``edp`` (:func:`shard_groups`), else None.
    Creating a Topology is collective over the world communicator.
    """

    def __init__(self, tcfg: TopologyConfig, world=None, placement: str = "auto"):
        self.cfg = tcfg
        self.placement = placement  # experimental.placement: "auto" or "naive"
        self.dims = grid_dims(tcfg)
        self.recorder = comm.Recorder()  # this run's communication record
        self.world = comm.with_recorder(world if world is not None else comm.world(),
                                        self.recorder)
        n = self.dims[0] * self.dims[1] * self.dims[2] * self.dims[3] * self.dims[4]
        if n != self.world.size:
            raise ValueError(f"grid {self.dims} has {n} ranks, world has {self.world.size}")
        # naive: tp strided across nodes (comparisons); auto: ranks packed by node first.
        if placement == "naive":
            key = naive_order(n, self.dims)[self.world.rank]
        else:
            key = packed_key(self.world)
        self.cart = comm.cartesian(self.world, self.dims, key)
        self.rank = self.cart.rank
        self.coords = rank_to_coords(self.rank, self.dims)
        F, T = False, True
        self.pp_comm = comm.sub(self.cart, (T, F, F, F, F), "pp")
        self.dp_comm = comm.sub(self.cart, (F, T, T, F, F), "dp")
        self.ep_comm = comm.sub(self.cart, (F, F, T, F, F), "ep")
        self.edp_comm = comm.sub(self.cart, (F, T, F, F, F), "edp")
        self.cp_comm = comm.sub(self.cart, (F, F, F, T, F), "cp")
        self.tp_comm = comm.sub(self.cart, (F, F, F, F, T), "tp")
        # Gradients of parameters replicated over cp are summed over dp x cp.
        self.dpcp_comm, self.edpcp_comm = self.dp_comm, self.edp_comm
        if tcfg.cp > 1:
            self.dpcp_comm = comm.sub(self.cart, (F, T, T, T, F), "dpcp")
            self.edpcp_comm = comm.sub(self.cart, (F, T, F, T, F), "edpcp")
        self.pp_prev, self.pp_next = comm.shift(self.cart, 0)
        self.node_comm = comm.node_local(self.cart)
        self.hsdp = shard_groups(self) if tcfg.shard_within else None
        self.within_node = check(self)  # axis -> every group inside one node
        self.hostname = comm.processor_name()

    # Sizes and ranks per axis, in the vocabulary of docs/design.md.
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
    def cp_size(self) -> int:
        return self.cp_comm.size

    @property
    def cp_rank(self) -> int:
        return self.cp_comm.rank

    @property
    def local_rank(self) -> int:
        return self.node_comm.rank

    def node_ranks(self) -> int:
        """Ranks per node, the fewest over the world. Collective over the world."""
        return int(self.world.allreduce(float(self.node_comm.size), "min"))

    def describe(self) -> str:
        """One line naming this rank, its grid coordinates and its node."""
        return f"rank {self.rank} {self.coords} on {self.hostname}"
