"""The one place a gradient-sync strategy is chosen and made: what the configuration asks
(:func:`reduction_mode`, :func:`progress_for`, :func:`overlap_on`; :func:`decided` for the
planner), the registry
(:data:`TABLE`: one row per strategy, its class, when it is chosen and what it refuses),
:func:`choose` (choices -> the class), :func:`strategy_of` (a configuration -> the class,
without a Topology: the planner's prices), :func:`refusal` (the config checks'),
:func:`create` (a strategy from explicit choices: tests, benchmarks, the planner's timers)
and :func:`build` (from the configuration, at set-up).

Importing this module imports neither torch nor MPI (``checks/`` asks it before either is
loaded); a row names its class as ``"module:Class"``, imported when the class is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from types import SimpleNamespace
from typing import NamedTuple

from ...config import microbatches as microbatches_per_rank


class Choice(NamedTuple):
    """What selects a strategy: ``optim.zero``, overlap, the reduction mode
    (``experimental.reduction``) and ``topology.dp_reduction``."""

    zero: int = 0
    overlap: bool = False
    mode: str = "bucketed"
    dp_reduction: str = "flat"


HIERARCHICAL = "topology.dp_reduction=hierarchical needs optim.zero=0"


def _mode_alone(c: Choice) -> str:
    return (f"experimental.reduction={c.mode} needs optim.zero=0, optim.overlap=false and "
            "topology.dp_reduction=flat (it replaces the bucketed reduction they use)")


def _sharded_needs(c: Choice) -> str | None:
    """ZeRO reduce-scatters the flat, bucketed reduction's buckets."""
    if c.dp_reduction != "flat":
        return HIERARCHICAL
    return _mode_alone(c) if c.mode != "bucketed" else None


def _mode_needs(c: Choice) -> str | None:
    """A reduction mode replaces the bucketed reduction: no ZeRO, overlap or hierarchy."""
    return _mode_alone(c) if c.zero or c.overlap or c.dp_reduction != "flat" else None


@dataclass(frozen=True)
class Row:
    """A strategy in the registry: its class (``"module:Class"``, a module relative to this
    package when it starts with a dot), when the choices select it (the first row whose
    ``when`` holds) and ``needs``: the refusal of choices it cannot serve (a message naming
    the keys and the fix), or None."""

    where: str
    when: Callable[[Choice], bool]
    needs: Callable[[Choice], str | None] = lambda c: None

    def load(self) -> type:
        module, _, name = self.where.partition(":")
        return getattr(import_module(module, __package__), name)


TABLE = [  # the registry, in the order rows are tried
    Row(".sharded:Zero1", lambda c: c.zero == 1, _sharded_needs),  # with or without overlap
    Row(".sharded:Zero2", lambda c: c.zero == 2, _sharded_needs),  # always overlapped
    Row(".sharded:Zero3", lambda c: c.zero == 3, _sharded_needs),  # always overlapped
    Row(".buckets:PerParameter", lambda c: c.mode == "per-parameter", _mode_needs),
    Row(".buckets:NonblockingBuckets", lambda c: c.mode == "bucketed-nonblocking", _mode_needs),
    Row(".buckets:OverlappedHierarchical", lambda c: c.dp_reduction == "hierarchical"
        and c.overlap),  # the progress thread runs each bucket's two levels
    Row(".buckets:HierarchicalBuckets", lambda c: c.dp_reduction == "hierarchical"),
    Row(".buckets:OverlappedBuckets", lambda c: c.overlap),  # optim.overlap, or across nodes
    Row(".buckets:BlockingBuckets", lambda c: True),  # the default
]


def row_for(choice: Choice) -> Row:
    """The registry's row for these choices; ValueError (its ``needs`` message) for choices
    the selected strategy cannot serve."""
    row = next(r for r in TABLE if r.when(choice))
    why = row.needs(choice)
    if why is not None:
        raise ValueError(why)
    return row


def choose(zero: int = 0, overlap: bool = False, mode: str = "bucketed",
           dp_reduction: str = "flat") -> type:
    """The strategy class for these choices (:data:`TABLE`); ValueError for combinations no
    strategy supports."""
    return row_for(Choice(zero, overlap, mode, dp_reduction)).load()


def choice_of(cfg) -> Choice:
    """The choices the configuration alone makes (no Topology: ``optim.overlap`` as given,
    not the overlap ``optim.overlap_across_nodes`` turns on where dp crosses nodes)."""
    return Choice(cfg.optim.zero, cfg.optim.overlap, reduction_mode(cfg),
                  cfg.topology.dp_reduction)


def refusal(cfg) -> str | None:
    """Why no strategy serves this configuration (the config checks' message), or None."""
    try:
        row_for(choice_of(cfg))
    except ValueError as e:
        return str(e)
    return None


def strategy_of(cfg) -> type:
    """The strategy class the configuration selects (:func:`choice_of`), whose class methods
    price it (``GradSync.memory``, ``dp_seconds`` ...); ValueError as :func:`choose`."""
    return row_for(choice_of(cfg)).load()


def strategies() -> list[type]:
    """Every registered strategy class, in the registry's order."""
    return [r.load() for r in TABLE]


# -- what the configuration asks ---------------------------------------------------------
def reduction_mode(cfg) -> str:
    """How zero 0 sums without overlap (``experimental.reduction``): ``bucketed`` (one
    blocking all-reduce per bucket, in order), ``bucketed-nonblocking`` (all buckets posted,
    then waited for) or ``per-parameter`` (the naive baseline the benchmarks compare with)."""
    return cfg.experimental.reduction


def progress_for(ocfg) -> str:
    """``optim.overlap_progress`` with ``auto`` decided: ``test``, ``MPI_Test`` from the
    gradient hooks (no thread to share the rank's core with backward, and no need of
    ``MPI_THREAD_MULTIPLE``; the comparison: docs/results.md, "Overlapped gradient
    reduction")."""
    return "test" if ocfg.overlap_progress == "auto" else ocfg.overlap_progress


def decided(cfg, dp_crosses: bool) -> tuple[str, bool]:
    """(progress, overlap) as :func:`build` decides them for dp groups that do or do not
    cross nodes: what the planner asks, without MPI or a Topology."""
    where = SimpleNamespace(within_node={"dp": not dp_crosses})
    return progress_for(cfg.optim), overlap_on(cfg.optim, where, cfg.topology.dp_reduction,
                                               reduction_mode(cfg))


def overlap_on(ocfg, topo, dp_reduction: str, reduction: str = "bucketed") -> bool:
    """Whether this run overlaps the dp reduction with backward: ``optim.overlap``, or
    (``optim.overlap_across_nodes``) a flat bucketed reduction whose dp groups cross nodes
    (``topo.within_node``, the same answer on every rank; edp groups lie inside dp's;
    ``reduction``: :func:`reduction_mode`). Inside a node every overlap measured slower than
    blocking buckets (docs/results.md)."""
    if ocfg.overlap:
        return True
    return bool(ocfg.overlap_across_nodes and not topo.within_node.get("dp", True)
                and reduction == "bucketed" and dp_reduction == "flat")


# -- making one --------------------------------------------------------------------------
def create(named, topo, bucket_mb: float, *, zero: int = 0, overlap: bool = False,
           microbatches: int = 1, mode: str = "bucketed", progress: str = "test",
           split: dict | None = None, chunks: list | None = None, wire=None):
    """The strategy for these choices over ``named`` parameters. ``split``: the two-level
    groups (``buckets.levels``) for a hierarchical reduction; ``chunks``: the model chunks,
    ZeRO-3 only (its units and hooks); ``wire``: the dtype reductions carry (None: the
    gradients' own; ``interface.wire_dtype``). Collective over the groups with more than
    one rank where a progress thread starts (``progress`` thread or poll) or ZeRO-3 shards."""
    from .interface import BucketLayout

    cls = choose(zero, overlap, mode, "flat" if split is None else "hierarchical")
    layout = BucketLayout(named, topo, bucket_mb, sharded=cls.zero_level > 0,
                          units=cls.units(chunks), wire=wire)
    return cls.from_choices(layout, overlap=overlap, microbatches=microbatches,
                            progress=progress, split=split, chunks=chunks)


def build(cfg, topo, chunks: list, named):
    """The grad sync for this configuration: ``optim.zero``, overlap (:func:`overlap_on`),
    its progress (:func:`progress_for`), the reduction mode (:func:`reduction_mode`) and
    ``topology.dp_reduction``, ``optim.grad_comm_dtype``. Collective over the world's dp,
    edp and tp groups."""
    from . import buckets
    from .interface import wire_dtype

    progress = progress_for(cfg.optim)  # how overlapped reductions advance
    mode = reduction_mode(cfg)
    overlap = overlap_on(cfg.optim, topo, cfg.topology.dp_reduction, mode)
    split = buckets.levels(topo)  # collective; None for a flat reduction
    return create(named, topo, cfg.optim.bucket_mb, zero=cfg.optim.zero, overlap=overlap,
                  microbatches=microbatches_per_rank(cfg), mode=mode,
                  progress=progress, split=split, chunks=chunks,
                  wire=wire_dtype(cfg.optim.grad_comm_dtype))
