"""The bucket strategies, zero 0: every bucket all-reduced over its group, whole gradients
on every rank; and the posting machinery they share with the ZeRO strategies.

- :class:`BlockingBuckets`, the default (``experimental.reduction = "bucketed"``, no
  overlap, flat dp): after backward, one blocking all-reduce per bucket, in bucket order (in
  bfloat16 on the wire with ``optim.grad_comm_dtype``). Nothing to overlap with: the
  blocking, tuned all-reduce of the MPI library is the path here; docs/results.md and
  docs/benchmarks.md ("Overlap and the naive baseline") compare it with nonblocking buckets
  (libnbc) and with overlap.
- :class:`PostedSync`: buckets handed to nonblocking collectives (not a strategy itself),
  after backward or from gradient hooks during it. With ``overlap`` the post-accumulate
  hooks count each parameter's gradients and post a bucket's reduction as soon as all its
  gradients are final: of the LAST microbatch (``per_microbatch`` False), or of every
  microbatch (ZeRO-2/3, ``per_microbatch`` True). :meth:`PostedSync._sum` posts what the
  hooks have not and waits for everything. How posted reductions progress while autograd
  computes is ``progress``: ``test`` (libnbc, ``MPI_Test`` on the oldest outstanding one
  from each hook), ``thread``/``poll`` (``comm.ProgressThread``: a thread runs them on a
  duplicate communicator, blocking or nonblocking + ``MPI_Test``), ``wait`` (libnbc, only
  the final wait). Posts follow one fixed sequence on every rank, (microbatch, bucket) in
  order, whatever the order in which hooks fire, so nonblocking collectives always match
  across the group.
- :class:`NonblockingBuckets` (``experimental.reduction = "bucketed-nonblocking"``): every
  bucket posted after backward, then waited for; :class:`OverlappedBuckets`
  (``optim.overlap`` or ``optim.overlap_across_nodes``): posted from the gradient hooks as
  soon as a bucket's gradients of the last microbatch are final.
- :class:`PerParameter` (``experimental.reduction = "per-parameter"``): the naive baseline,
  one blocking all-reduce per parameter, no buckets on the wire; for comparisons only
  (``benchmarks/gradsync.py``); the gradients still live in the flat buffers of the layout.
- :class:`HierarchicalBuckets` (``topology.dp_reduction = "hierarchical"``): a bucket summed
  over a dp group that spans nodes in three steps: reduce-scatter within the node,
  all-reduce of each shard across nodes (between ranks with the same node-local rank),
  all-gather within the node. Each node's link then carries one copy of the bucket per node
  rather than one per rank. The two-level groups are built at set-up (:func:`levels`);
  nodes holding unequal numbers of a group's ranks fall back to the flat all-reduce.
  :class:`OverlappedHierarchical` (with ``optim.overlap``): the same three steps per bucket,
  posted from the gradient hooks and run by the progress thread on duplicates of the two
  levels while backward goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from .interface import (
    Bucket,
    BucketLayout,
    GradSync,
    carried,
    group_key,
    main_grad,
    op_for,
    outgoing,
)


class BlockingBuckets(GradSync):
    """Each bucket all-reduced in place, one after another."""

    name = "blocking"

    def _sum(self) -> None:
        for b in self.buckets:
            b.posted += 1
            carried(b.group, b.flat, self.layout.wire, b.group.allreduce_)


# -- posted reductions ------------------------------------------------------------------
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

    @classmethod
    def spins(cls, cfg, progress: str) -> bool:
        """The blocking progress thread of an overlapped reduction (``poll`` sleeps)."""
        return progress == "thread" and cls.overlapped(cfg)

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


class NonblockingBuckets(PostedSync):
    """All buckets posted after backward, then waited for."""

    name = "nonblocking"
    progress = "wait"

    def __init__(self, layout, *, microbatches: int = 1):
        super().__init__(layout, overlap=False, microbatches=microbatches, progress="wait")

    @classmethod
    def from_choices(cls, layout, *, microbatches: int = 1, **_) -> NonblockingBuckets:
        return cls(layout, microbatches=microbatches)


class OverlappedBuckets(PostedSync):
    """Buckets posted from the gradient hooks during the last microbatch's backward."""

    name = "overlapped"

    def __init__(self, layout, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, overlap=True, microbatches=microbatches, progress=progress)

    @classmethod
    def from_choices(cls, layout, *, microbatches: int = 1, progress: str = "test",
                     **_) -> OverlappedBuckets:
        return cls(layout, microbatches=microbatches, progress=progress)

    @classmethod
    def hooks(cls, cfg) -> bool:
        """Every parameter's hook counts its gradients."""
        return True

    @classmethod
    def posts(cls, cfg, nb: int, M: int) -> int:
        """Every bucket once, from the last microbatch's hooks."""
        return nb


# -- the naive baseline ----------------------------------------------------------------
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


# -- hierarchical ----------------------------------------------------------------------
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
    algorithm = "hierarchical"  # the planner's two-level all-reduce (planner/collectives.py)

    def __init__(self, layout, split: dict[str, Hierarchy]):
        self.split = split
        super().__init__(layout)

    @classmethod
    def from_choices(cls, layout, *, split: dict[str, Hierarchy], **_) -> HierarchicalBuckets:
        return cls(layout, split)

    def _sum(self) -> None:
        for b in self.buckets:
            h = self.split[b.group.axis]
            carried(b.group, b.flat, self.layout.wire,
                    lambda t, *op, h=h: reduce_hierarchical(h, t, *op))


class OverlappedHierarchical(OverlappedBuckets):
    """Buckets posted from the gradient hooks during the last microbatch's backward, each
    summed by :func:`reduce_hierarchical` on the progress thread (its duplicates of the
    group's two levels, ``split``) while backward goes on. Always the blocking thread: the
    three steps are one job."""

    name = "overlapped-hierarchical"
    algorithm = "hierarchical"

    def __init__(self, layout, split: dict[str, Hierarchy], *, microbatches: int = 1):
        self.split = split  # before the progress thread, which duplicates its groups
        super().__init__(layout, microbatches=microbatches, progress="thread")

    @classmethod
    def from_choices(cls, layout, *, split: dict[str, Hierarchy], microbatches: int = 1,
                     **_) -> OverlappedHierarchical:
        return cls(layout, split, microbatches=microbatches)

    @classmethod
    def spins(cls, cfg, progress: str) -> bool:
        """Always the blocking thread."""
        return True

    def _progress_thread(self) -> comm.ProgressThread | None:
        """The thread over the groups and both levels of every hierarchy with a bucket to
        reduce. Collective over each of them."""
        used = {b.group.axis: self.split[b.group.axis] for b in self.buckets
                if b.group.size > 1}
        groups = list({id(g): g for h in used.values()
                       for g in (h.group, h.local, h.cross)}.values())
        return comm.ProgressThread(groups) if groups else None

    def _start(self, b: Bucket, thread) -> tuple | None:
        if b.group.size == 1:
            return None
        h = self.split[b.group.axis]
        sent = outgoing(b.flat, b.group, self.layout.wire)
        op = op_for(sent, self.layout.wire)

        def reduce(group, local, cross):
            reduce_hierarchical(Hierarchy(group, local, cross, h.uniform), sent, *op)

        handle = thread.call([h.group, h.local, h.cross], reduce, sent.nbytes, sent,
                             "hierarchical allreduce")
        return handle, (None if sent is b.flat else sent)
