"""Posted reductions: the machinery shared by every strategy that hands buckets to
nonblocking collectives (:class:`PostedSync`), after backward or from gradient hooks during
it; not a strategy itself.

With ``overlap`` the post-accumulate hooks count each parameter's gradients and post a
bucket's reduction as soon as all its gradients are final: of the LAST microbatch
(``per_microbatch`` False), or of every microbatch (ZeRO-2/3, ``per_microbatch`` True).
:meth:`PostedSync._sum` posts what the hooks have not and waits for everything. How posted
reductions progress while autograd computes is ``progress``: ``test`` (libnbc, ``MPI_Test``
on the oldest outstanding one from each hook), ``thread``/``poll`` (``comm.ProgressThread``: a
thread runs them on a duplicate communicator, blocking or nonblocking + ``MPI_Test``),
``wait`` (libnbc, only the final wait).

Posts follow one fixed sequence on every rank, (microbatch, bucket) in order, whatever the
order in which hooks fire, so nonblocking collectives always match across the group.
"""

from __future__ import annotations

import torch

from ... import comm
from .base import GradSync
from .layout import Bucket, BucketLayout
from .wire import op_for, outgoing

POLL_S = 0.0005  # optim.overlap_progress = "poll": seconds between MPI_Test calls


class PostedSync(GradSync):
    """Buckets posted as nonblocking reductions in the fixed order. Subclasses say what a
    post starts (:meth:`_start`: an all-reduce here)."""

    per_microbatch = False  # a reduction per bucket and microbatch (ZeRO-2/3)

    def __init__(self, layout: BucketLayout, *, overlap: bool = False, microbatches: int = 1,
                 progress: str = "test"):
        self.overlap, self.microbatches, self.progress = overlap, microbatches, progress
        self._count = {id(p): 0 for _, p in layout.named}  # gradients accumulated this step
        self._pending: list = []  # (handle, bucket, recv or None)
        self._tested = 0  # _pending[:_tested] are complete (progress: test)
        self._next = 0  # reductions posted this step: the next is (k, bucket) = divmod
        super().__init__(layout)
        self.progress_thread = self._progress_thread()

    def _progress_thread(self) -> comm.ProgressThread | None:
        """The thread that runs overlapped reductions (``progress`` thread or poll), over the
        groups with more than one rank. Collective over them (each is duplicated)."""
        if not self.overlap or self.progress not in ("thread", "poll"):
            return None
        used = [g for g in self.layout.groups.values()
                if any(b.group is g for b in self.buckets) and g.size > 1]
        poll_s = POLL_S if self.progress == "poll" else 0.0
        return comm.ProgressThread(used, poll_s) if used else None

    def close(self) -> None:
        """Stop the progress thread, if any (after the reductions already posted)."""
        if self.progress_thread is not None:
            self.progress_thread.close()
            self.progress_thread = None

    def zero(self) -> None:
        super().zero()
        self._next = 0
        for k in self._count:
            self._count[k] = 0

    # -- hooks ---------------------------------------------------------------------------
    def _hooked(self, p: torch.Tensor) -> bool:
        return self.overlap or super()._hooked(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate hook: accumulate (:meth:`_accumulate`); with overlap, count the
        gradient and post what is ready."""
        self._accumulate(p)
        if self.overlap:
            self._count[id(p)] += 1
            self.layout.where[id(p)][0].arrived += 1
            self._post_ready()
            if self.progress == "test":
                self._drive()

    def _drive(self) -> None:
        """Drive libnbc from a hook (MPI progresses only inside calls): ``MPI_Test`` on the
        oldest reduction not yet complete; one call progresses every outstanding nonblocking
        collective of the process. Complete ones are passed once, so a hook costs O(1), not
        O(reductions posted this step)."""
        pending = self._pending
        while self._tested < len(pending) and pending[self._tested][0].test():
            self._tested += 1

    # -- posting -------------------------------------------------------------------------
    def _post_ready(self, flush: bool = False) -> None:
        """Post reductions in the fixed (microbatch, bucket) order while they are ready: a
        bucket is ready at microbatch count k (1 .. M per microbatch, else M only);
        ``flush`` posts all that remain."""
        per_mb, n = self.per_microbatch, len(self.buckets)
        while self._next < (self.microbatches if per_mb else 1) * n:
            i, j = divmod(self._next, n)
            k, b = (i + 1 if per_mb else self.microbatches), self.buckets[j]
            # every parameter has k gradients: the sum first (one comparison), the minimum
            # only once the sum allows it (O(1) per hook, not O(parameters per bucket))
            if not flush and (b.arrived < k * len(b.params)
                              or min(self._count[id(p)] for p in b.params) < k):
                return
            self.posted_early += not flush
            self._post(b)

    def _post(self, b: Bucket) -> None:
        b.posted += 1
        self._next += 1
        thread = self.progress_thread if b.group.size > 1 else None
        started = self._start(b, thread)
        if started is not None:
            self._pending.append((started[0], b, started[1]))

    def _start(self, b: Bucket, thread) -> tuple | None:
        """Start ``b``'s reduction: (handle, receive buffer or None), or None when there is
        nothing to send. Here: the bucket all-reduced in place, or its wire copy (copied back
        into the bucket after the wait)."""
        if b.group.size == 1:
            return None
        sent = outgoing(b.flat, b.group, self.layout.wire)
        op = op_for(sent, self.layout.wire)
        h = thread.allreduce_(b.group, sent, *op) if thread is not None \
            else b.group.iallreduce_(sent, *op)
        return h, (None if sent is b.flat else sent)

    def _wait_all(self) -> None:
        for handle, b, recv in self._pending:
            handle.wait()
            if recv is not None:  # a shard's part (zero 1-3), or a bucket's wire copy
                b.shard.add_(recv) if self.zero_level else b.flat.copy_(recv)
        self._pending, self._tested = [], 0

    def _sum(self) -> None:
        self._post_ready(flush=True)
        self._wait_all()
