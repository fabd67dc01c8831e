"""Blocking buckets, the default (``experimental.reduction = "bucketed"``, zero 0, no overlap, flat
dp): after backward, one blocking all-reduce per bucket, in bucket order (in bfloat16 on the
wire with ``optim.grad_comm_dtype``: ``wire.py``).

Nothing to overlap with: the blocking, tuned all-reduce of the MPI library is the path here;
docs/results.md and docs/benchmarks.md ("Overlap and the naive baseline") compare it with
nonblocking buckets (libnbc) and with overlap.
"""

from __future__ import annotations

from .base import GradSync
from .wire import carried


class BlockingBuckets(GradSync):
    """Each bucket all-reduced in place, one after another."""

    name = "blocking"

    def _sum(self) -> None:
        for b in self.buckets:
            b.posted += 1
            carried(b.group, b.flat, self.layout.wire, b.group.allreduce_)
