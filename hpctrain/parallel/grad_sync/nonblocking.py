"""Nonblocking buckets, zero 0: every bucket's all-reduce posted as a nonblocking collective,
either after backward (:class:`NonblockingBuckets`, ``experimental.reduction =
"bucketed-nonblocking"``) or from the gradient hooks as soon as a bucket's gradients of the
last microbatch are final (:class:`OverlappedBuckets`, ``optim.overlap`` or
``optim.overlap_across_nodes``; ``posting.py`` has the progress modes)."""

from __future__ import annotations

from .posting import PostedSync


class NonblockingBuckets(PostedSync):
    """All buckets posted after backward, then waited for."""

    name = "nonblocking"
    progress = "wait"

    def __init__(self, layout, *, microbatches: int = 1):
        super().__init__(layout, overlap=False, microbatches=microbatches, progress="wait")


class OverlappedBuckets(PostedSync):
    """Buckets posted from the gradient hooks during the last microbatch's backward."""

    name = "overlapped"

    def __init__(self, layout, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, overlap=True, microbatches=microbatches, progress=progress)
