"""The one place a gradient-sync strategy is chosen: :func:`build` reads the configuration,
:func:`create` takes the choices as arguments (tests, benchmarks, the planner's timers),
:func:`choose` is the table itself.

================================================  ======================  ==================
configuration                                     strategy                module
================================================  ======================  ==================
zero 0, reduction per-parameter                   PerParameter            per_parameter.py
zero 0, reduction bucketed-nonblocking            NonblockingBuckets      nonblocking.py
zero 0, topology.dp_reduction hierarchical        HierarchicalBuckets     hierarchical.py
zero 0, overlap (optim.overlap, or across nodes)  OverlappedBuckets       nonblocking.py
zero 0, otherwise (the default)                   BlockingBuckets         blocking.py
zero 1 (with or without overlap)                  Zero1                   sharded.py
zero 2 (always overlapped)                        Zero2                   sharded.py
zero 3 (always overlapped)                        Zero3                   zero3.py
================================================  ======================  ==================
"""

from __future__ import annotations

from ...config import microbatches as microbatches_per_rank
from . import hierarchical
from .base import GradSync
from .blocking import BlockingBuckets
from .choice import overlap_on, progress_for, reduction_mode
from .layout import BucketLayout
from .nonblocking import NonblockingBuckets, OverlappedBuckets
from .per_parameter import PerParameter
from .sharded import Zero1, Zero2
from .wire import wire_dtype
from .zero3 import Zero3, units_of

STRATEGIES = (BlockingBuckets, NonblockingBuckets, OverlappedBuckets, PerParameter,
              hierarchical.HierarchicalBuckets, Zero1, Zero2, Zero3)


def choose(zero: int = 0, overlap: bool = False, mode: str = "bucketed",
           dp_reduction: str = "flat") -> type[GradSync]:
    """The strategy class for these choices (the table above); ValueError for combinations
    no strategy supports (``checks/rules.py`` refuses them before set-up)."""
    if zero and dp_reduction != "flat":
        raise ValueError("optim.zero > 0 needs topology.dp_reduction = flat")
    if mode != "bucketed" and (zero or overlap or dp_reduction != "flat"):
        raise ValueError(f"experimental.reduction={mode} needs zero 0, no overlap, flat dp")
    if overlap and dp_reduction != "flat":
        raise ValueError("topology.dp_reduction = hierarchical needs optim.overlap = false")
    if zero:
        return {1: Zero1, 2: Zero2, 3: Zero3}[zero]
    if mode == "per-parameter":
        return PerParameter
    if mode == "bucketed-nonblocking":
        return NonblockingBuckets
    if dp_reduction == "hierarchical":
        return hierarchical.HierarchicalBuckets
    return OverlappedBuckets if overlap else BlockingBuckets


def create(named, topo, bucket_mb: float, *, zero: int = 0, overlap: bool = False,
           microbatches: int = 1, mode: str = "bucketed", progress: str = "test",
           split: dict | None = None, chunks: list | None = None,
           wire=None) -> GradSync:
    """The strategy for these choices over ``named`` parameters. ``split``: the two-level
    groups (``hierarchical.levels``) for a hierarchical reduction; ``chunks``: the model
    chunks, ZeRO-3 only (its units and hooks); ``wire``: the dtype reductions carry (None:
    the gradients' own; ``wire.py``). Collective over the groups with more than one
    rank where a progress thread starts (``progress`` thread or poll) or ZeRO-3 shards."""
    cls = choose(zero, overlap, mode, "flat" if split is None else "hierarchical")
    units = units_of(chunks) if cls is Zero3 else None
    layout = BucketLayout(named, topo, bucket_mb, sharded=zero > 0, units=units, wire=wire)
    if cls is Zero3:
        return Zero3(layout, chunks, microbatches=microbatches, progress=progress)
    if cls in (Zero2, OverlappedBuckets):
        return cls(layout, microbatches=microbatches, progress=progress)
    if cls is Zero1:
        return Zero1(layout, overlap=overlap, microbatches=microbatches, progress=progress)
    if cls is NonblockingBuckets:
        return cls(layout, microbatches=microbatches)
    if cls is hierarchical.HierarchicalBuckets:
        return cls(layout, split)
    return cls(layout)


def build(cfg, topo, chunks: list, named) -> GradSync:
    """The grad sync for this configuration: ``optim.zero``, overlap (:func:`overlap_on`),
    its progress (:func:`progress_for`), the reduction mode (:func:`reduction_mode`) and
    ``topology.dp_reduction``, ``optim.grad_comm_dtype``. Collective over the world's dp,
    edp and tp groups."""
    progress = progress_for(cfg.optim, topo)  # how overlapped reductions advance
    mode = reduction_mode(cfg)
    overlap = overlap_on(cfg.optim, topo, cfg.topology.dp_reduction, progress, mode)
    split = hierarchical.levels(topo)  # collective; None for a flat reduction
    return create(named, topo, cfg.optim.bucket_mb, zero=cfg.optim.zero, overlap=overlap,
                  microbatches=microbatches_per_rank(cfg), mode=mode,
                  progress=progress, split=split, chunks=chunks,
                  wire=wire_dtype(cfg.optim.grad_comm_dtype))
