"""What the configuration asks of the gradient sync, decided once at set-up and the same on
every rank: the reduction mode (:func:`reduction_mode`, the one place that reads it), how
overlapped reductions progress (:func:`progress_for`) and whether this run overlaps at all
(:func:`overlap_on`). ``factory.build`` turns the answers into a strategy."""

from __future__ import annotations

from ... import comm


def reduction_mode(cfg) -> str:
    """How zero 0 sums without overlap (``experimental.reduction``): ``bucketed`` (one
    blocking all-reduce per bucket, in order), ``bucketed-nonblocking`` (all buckets posted,
    then waited for) or ``per-parameter`` (the naive baseline the benchmarks compare with)."""
    return cfg.experimental.reduction


def progress_for(ocfg, topo) -> str:
    """``optim.overlap_progress`` with ``auto`` decided: the progress thread where the dp
    groups cross nodes (``topo.within_node``, the same on every rank) and MPI provides
    ``MPI_THREAD_MULTIPLE``, else ``test`` (the comparison: docs/results.md, "Overlapped
    gradient reduction")."""
    if ocfg.overlap_progress != "auto":
        return ocfg.overlap_progress
    crosses = not topo.within_node.get("dp", True)
    return "thread" if crosses and comm.thread_multiple()[0] else "test"


def overlap_on(ocfg, topo, dp_reduction: str, progress: str, reduction: str = "bucketed") -> bool:
    """Whether this run overlaps the dp reduction with backward: ``optim.overlap``, or
    (``optim.overlap_across_nodes``) a flat bucketed reduction whose dp groups cross nodes
    (``topo.within_node``, the same answer on every rank; edp groups lie inside dp's) with a
    progress that wins there: not ``auto``'s fallback ``test``, which does not beat blocking
    buckets over TCP (docs/results.md; ``progress``: :func:`progress_for`; ``reduction``:
    :func:`reduction_mode`)."""
    if ocfg.overlap:
        return True
    wins = ocfg.overlap_progress != "auto" or progress != "test"
    return bool(ocfg.overlap_across_nodes and not topo.within_node.get("dp", True) and wins
                and reduction == "bucketed" and dp_reduction == "flat")
