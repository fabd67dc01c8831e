"""Where ranks sit on nodes, and the hierarchical gradient reduction that uses it.

A node is the set of ranks that share memory (``Split_type(COMM_TYPE_SHARED)``). The grid
puts ``tp`` fastest, so with ranks packed by node (``srun``'s and ``mpirun``'s default)
consecutive ranks form a tensor-parallel group inside one node. ``topology.placement``:

- ``auto``: :func:`packed_key` renumbers the world so that ranks ARE packed by node even
  when the launcher interleaved them (``--map-by node``); :func:`check` then verifies that
  each tp (and ep) group lies within one node and warns when it cannot (e.g. ranks per node
  not a multiple of tp);
- ``naive``: ``topology.naive_order`` strides tp groups across nodes, for comparisons.

:func:`crossing` answers the same question without MPI for ``hpctrain plan --nodes N``.

Hierarchical reduction (``topology.dp_reduction = "hierarchical"``) of a gradient bucket
summed over a dp group that spans nodes: reduce-scatter within the node, all-reduce each
shard across nodes (between ranks with the same node-local rank), all-gather within the
node. Each node's link then carries one copy of the bucket per node rather than one per rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from . import comm
from .topology import grid_dims, naive_order, rank_to_coords

# Which grid dims vary within one group of each axis (dims: pp, dp_outer, ep, tp).
AXIS_DIMS = {"tp": (3,), "ep": (2,), "dp": (1, 2), "pp": (0,)}


# -- placement --------------------------------------------------------------------------------
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
    or ep groups cross nodes. Collective over the world and over each axis group."""
    groups = {"tp": topo.tp_comm, "ep": topo.ep_comm, "dp": topo.dp_comm, "pp": topo.pp_comm}
    within = {}
    for axis, g in groups.items():
        local = comm.node_local(g, axis=f"{axis}-node")
        within[axis] = topo.world.allreduce(float(local.size == g.size), "min") == 1.0
    if topo.cfg.placement == "auto" and topo.world.rank == 0:
        for axis in ("tp", "ep"):
            if not within[axis] and groups[axis].size > 1:
                msg = (f"placement: {axis} groups (size {groups[axis].size}) cross nodes of "
                       f"{topo.node_comm.size} ranks; make ranks per node a multiple of "
                       f"{axis} so they stay on the fast link")
                (warn or _stderr)(msg)
    return within


def _stderr(msg: str) -> None:
    print(f"[hpctrain] warning: {msg}", file=sys.stderr, flush=True)


def crossing(tcfg, nodes: int, ranks_per_node: int) -> dict[str, tuple[int, int]]:
    """Without MPI: for each axis, (groups that span more than one node, groups), when
    ``nodes * ranks_per_node`` ranks are packed by node and placed as ``tcfg.placement``."""
    dims = grid_dims(tcfg)
    n = dims[0] * dims[1] * dims[2] * dims[3]
    if nodes * ranks_per_node != n:
        raise ValueError(f"--nodes {nodes} x --ranks-per-node {ranks_per_node} = "
                         f"{nodes * ranks_per_node} ranks, the layout has {n}")
    key = naive_order(n, dims) if tcfg.placement == "naive" else list(range(n))
    node_of = {key[w]: w // ranks_per_node for w in range(n)}  # grid rank -> node
    out = {}
    for axis, varying in AXIS_DIMS.items():
        groups: dict[tuple, set] = {}
        for g in range(n):
            c = rank_to_coords(g, dims)
            values = (c.pp, c.dp_outer, c.ep, c.tp)
            fixed = tuple(v for i, v in enumerate(values) if i not in varying)
            groups.setdefault(fixed, set()).add(node_of[g])
        out[axis] = (sum(len(s) > 1 for s in groups.values()), len(groups))
    return out


def plan_section(cfg, nodes: int, ranks_per_node: int) -> list[str]:
    """``hpctrain plan --nodes N --ranks-per-node K``: which axes cross the inter-node link."""
    t = cfg.topology
    cross = crossing(t, nodes, ranks_per_node)
    sizes = {"tp": t.tp, "ep": t.ep, "dp": t.dp, "pp": t.pp}
    lines = [f"placement {t.placement} on {nodes} node(s) x {ranks_per_node} rank(s), "
             f"dp reduction {t.dp_reduction}:"]
    for axis, (n_cross, n_groups) in cross.items():
        if sizes[axis] == 1:
            continue
        where = "inside a node" if n_cross == 0 else \
            f"CROSSES the inter-node link ({n_cross} of {n_groups} groups)"
        lines.append(f"  {axis}={sizes[axis]}: {where}")
    if cross["tp"][0] and t.tp > 1:
        lines.append("  warning: tp all-reduces every layer; keep it inside a node")
    if cross["dp"][0] and t.dp_reduction == "flat" and t.dp > nodes:
        lines.append("  hint: dp spans nodes with several dp ranks per node: "
                     "topology.dp_reduction=hierarchical sends less over the link")
    return lines


# -- hierarchical reduction -------------------------------------------------------------------
@dataclass
class Hierarchy:
    """A group split in two levels: ``local`` (its ranks on this node) and ``cross`` (its
    ranks with the same local rank, one per node). ``uniform``: every node holds the same
    number of the group's ranks (else the reduction falls back to flat)."""

    group: comm.Group
    local: comm.Group
    cross: comm.Group
    uniform: bool


def build_hierarchy(group: comm.Group, node_color: int | None = None) -> Hierarchy:
    """Split ``group`` by node (``node_color`` overrides the shared-memory node, for tests that
    pretend one machine is several nodes). Collective over ``group``."""
    if node_color is None:
        local = comm.node_local(group, axis=f"{group.axis}-local")
    else:
        local = comm.split(group, node_color, group.rank, f"{group.axis}-local")
    cross = comm.split(group, local.rank, group.rank, f"{group.axis}-cross")
    sizes = group.allgather_obj(local.size)
    return Hierarchy(group, local, cross, len(set(sizes)) == 1)


def reduce_hierarchical(h: Hierarchy, flat: torch.Tensor) -> None:
    """Sum ``flat`` (1-D, in place) over ``h.group`` in three steps: reduce-scatter over
    ``local``, all-reduce of this rank's shard over ``cross``, all-gather over ``local``.
    Collective over ``h.group``; equal to ``h.group.allreduce_(flat)`` up to summation order."""
    if h.group.size == 1:
        return
    if not h.uniform or h.local.size == 1 or h.cross.size == 1:
        h.group.allreduce_(flat)  # one level only: the flat collective is the hierarchy
        return
    n, k = flat.numel(), h.local.size
    shard_n = -(-n // k)
    padded = flat if shard_n * k == n else torch.cat(
        [flat, flat.new_zeros(shard_n * k - n)])  # (k * shard_n,)
    shard = flat.new_empty(shard_n)
    h.local.reduce_scatter(padded, shard)  # this node's sum of block local.rank
    h.cross.allreduce_(shard)  # the global sum of that block
    h.local.allgather(shard, padded)  # every block, on every rank of the node
    if padded is not flat:
        flat.copy_(padded[:n])


def dp_levels(topo) -> dict[str, Hierarchy] | None:
    """The two-level split of ``dp_comm`` and ``edp_comm`` when ``topology.dp_reduction =
    "hierarchical"``, else None. Collective over each (called by ``Topology``)."""
    if topo.cfg.dp_reduction != "hierarchical":
        return None
    return {"dp": build_hierarchy(topo.dp_comm), "edp": build_hierarchy(topo.edp_comm)}


def hierarchical_hook(topo):
    """The per-bucket callable for ``GradBuffers(hierarchical=...)``, or None (flat)."""
    levels = topo.dp_levels
    if levels is None:
        return None
    return lambda bucket: reduce_hierarchical(levels[bucket.group.axis], bucket.flat)
