"""HSDP in the cost model (``topology.shard_within``, ZeRO 1-3): the ZeRO collectives stay
inside a shard group of ``s`` of the dp x cp replicas, on the intra-node link when a group
fits in a node, and every step adds one all-reduce of this rank's gradient shard (``P/s``)
across the ``dp*cp/s`` shard groups, on the dp group's link (inter-node as soon as dp
spans nodes). Memory: state divided by ``s``, not dp x cp (``planner.memory.estimate``).
"""

from __future__ import annotations

import dataclasses

from ..config import Config, shard_size
from ..parallel.grad_sync.interface import wire_bytes
from .cluster import Cluster, Link
from .collectives import allreduce, summed


def on_cluster(cfg: Config, cluster: Cluster) -> Config:
    """``cfg`` with ``topology.shard_within = "node"`` replaced by the size it has on
    ``cluster``: the dp x cp ranks one node holds (ranks packed by node, tp fastest).
    ValueError when that size does not divide dp x cp."""
    t = cfg.topology
    if t.shard_within != "node":
        return cfg
    d, world = t.dp * t.cp, t.dp * t.tp * t.pp * t.cp
    k = max(1, min(d, min(cluster.ranks_per_node, world) // t.tp))
    if d % k:
        raise ValueError(f"topology.shard_within=node: a node of {cluster.name} holds {k} of "
                         f"the dp*cp = {d} replicas, which does not divide them; give a size")
    return dataclasses.replace(cfg, topology=dataclasses.replace(t, shard_within=str(k)))


def groups(cfg: Config, cluster: Cluster, links: dict) -> tuple[int, Link, Link]:
    """(shard group size, the shard groups' link, the replica groups' link) for a config
    with a size (:func:`on_cluster`); without HSDP (dp x cp, dp's link, dp's link)."""
    t = cfg.topology
    d, s = t.dp * t.cp, shard_size(t)
    if s >= d:
        return d, links["dp"], links["dp"]
    rpn = min(cluster.ranks_per_node, t.dp * t.tp * t.pp * t.cp)
    inside = rpn % (s * t.tp) == 0  # each group a block of s*tp ranks within one node
    return s, cluster.intra if inside else links["dp"], links["dp"]


def across(cfg: Config, cluster: Cluster, link: Link, P: int, calls: int) -> float:
    """Seconds of the step's all-reduces of the gradient shards across shard groups
    (``calls`` buckets: one collective's latencies each); 0 without HSDP."""
    t = cfg.topology
    d, s = t.dp * t.cp, shard_size(t)
    if s >= d:
        return 0.0
    gs = wire_bytes(cfg)
    r = d // s
    # the across groups touching a node, each with its share of the node's dp ranks
    rpn = min(cluster.ranks_per_node, d * t.tp * t.pp)
    per_node = max(1, min(d, rpn // t.tp) // s)
    adds = summed(P / s, r) * (cluster.sum16_s if gs == 2 else 0.0)
    return adds + allreduce(P * gs / s, r, link, cluster.collective, flows=rpn // per_node) \
        + (calls - 1) * 2 * (r - 1) * link.latency
