"""Hierarchical data-parallel gradient reduction across nodes.

``topology.dp_reduction = "hierarchical"``: a gradient bucket summed over a dp group that
spans nodes is reduced in three steps: reduce-scatter within the node, all-reduce of each
shard across nodes (between ranks with the same node-local rank), all-gather within the
node. Each node's link then carries one copy of the bucket per node rather than one per
rank. The two-level groups are built at set-up (:func:`levels`); nodes holding unequal
numbers of a group's ranks fall back to the flat all-reduce. :class:`HierarchicalBuckets` is
the strategy (zero 0, no overlap): each bucket reduced this way after backward, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from .base import GradSync
from .wire import carried


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


def reduce_hierarchical(h: Hierarchy, flat: torch.Tensor, op: str = "sum") -> None:
    """Sum ``flat`` (1-D, in place) over ``h.group`` in three steps: reduce-scatter over
    ``local``, all-reduce of this rank's shard over ``cross``, all-gather over ``local``.
    Collective over ``h.group``; equal to ``h.group.allreduce_(flat)`` up to summation order.
    ``op``: ``sum``, or ``sum16`` for a bfloat16 ``flat`` carried as 16-bit words."""
    if h.group.size == 1:
        return
    if not h.uniform or h.local.size == 1 or h.cross.size == 1:
        h.group.allreduce_(flat, op)  # one level only: the flat collective is the hierarchy
        return
    n, k = flat.numel(), h.local.size
    shard_n = -(-n // k)
    padded = flat if shard_n * k == n else torch.cat(
        [flat, flat.new_zeros(shard_n * k - n)])  # (k * shard_n,)
    shard = flat.new_empty(shard_n)
    h.local.reduce_scatter(padded, shard, op)  # this node's sum of block local.rank
    h.cross.allreduce_(shard, op)  # the global sum of that block
    h.local.allgather(shard, padded)  # every block, on every rank of the node
    if padded is not flat:
        flat.copy_(padded[:n])


def levels(topo) -> dict[str, Hierarchy] | None:
    """The two-level split of the gradient groups ``dpcp_comm`` and ``edpcp_comm`` (``dp_comm``
    and ``edp_comm`` when cp = 1) when ``topology.dp_reduction = "hierarchical"``, else None;
    keyed by the groups' axis names. Collective over each."""
    if topo.cfg.dp_reduction != "hierarchical":
        return None
    return {g.axis: build_hierarchy(g) for g in (topo.dpcp_comm, topo.edpcp_comm)}


class HierarchicalBuckets(GradSync):
    """Each bucket summed by :func:`reduce_hierarchical` over its group's two levels
    (``split``: :func:`levels`), one after another."""

    name = "hierarchical"

    def __init__(self, layout, split: dict[str, Hierarchy]):
        self.split = split
        super().__init__(layout)

    def _sum(self) -> None:
        for b in self.buckets:
            h = self.split[b.group.axis]
            carried(b.group, b.flat, self.layout.wire,
                    lambda t, *op, h=h: reduce_hierarchical(h, t, *op))
