"""The naive baseline (``experimental.reduction = "per-parameter"``): one blocking all-reduce per
parameter, no buckets on the wire. For comparisons only (``benchmarks/gradsync.py``); the
gradients still live in the flat buffers of the layout."""

from __future__ import annotations

from .base import GradSync
from .layout import BucketLayout, group_key, main_grad


def reduce_per_parameter(layout: BucketLayout) -> None:
    """Sequence-parallel partial gradients over tp, then every parameter over its group, one
    call each. Collective over dp_comm, edp_comm and tp_comm."""
    topo = layout.topo
    for p in layout.sp_params:
        topo.tp_comm.allreduce_(main_grad(p))
    for _, p in layout.named:
        layout.groups[group_key(p)].allreduce_(main_grad(p))


class PerParameter(GradSync):
    """One all-reduce per parameter (:func:`reduce_per_parameter`)."""

    name = "per-parameter"

    def _sum(self) -> None:
        reduce_per_parameter(self.layout)

    def _finish(self) -> None:
        """Nothing: :meth:`_sum` summed the sequence-parallel partial gradients first."""
