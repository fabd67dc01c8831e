"""The interface every gradient-sync strategy implements (:class:`GradSync`), and what they
share: the bucket layout's storage, the 16-bit main-grad hook, clearing before a step, and the
tail of every reduction (ZeRO-3's gathered parameters freed, sequence-parallel partial
gradients summed over tp).

A strategy is chosen once at set-up (``factory.py``); the step calls :meth:`GradSync.zero`
before the microbatches, :meth:`GradSync.reduce` after them, and :meth:`GradSync.close` once
at the end. The optimizer reads ``buckets``, ``named``, ``zero_level`` and, for sharded
strategies, each bucket's ``shard`` (:meth:`GradSync.segments` maps shards to parameters).

The loss is scaled by 1/(global tokens) before backward, so the *sum* over ranks is exactly
the gradient of the global mean loss (no division after the reduction).
"""

from __future__ import annotations

import abc

import torch

from .layout import LOW, Bucket, BucketLayout, main_grad
from .wire import op_for, outgoing


class GradSync(abc.ABC):
    """Gradients of one rank's parameters, summed over the data-parallel groups.

    Attributes every strategy has: ``name`` (the factory's table), ``zero_level`` (0: full
    gradients, 1-3: this rank's reduced shard per bucket), ``overlap`` (reductions posted from
    gradient hooks during backward), ``progress`` (how posted reductions advance), ``named``,
    ``buckets``, ``flats`` (flat gradient buffers, empty without), ``sharded`` (ZeRO-3's
    parameter shards, else None), ``posted_early`` (reductions posted during backward this
    step)."""

    name = ""
    zero_level = 0
    overlap = False
    progress = "none"

    def __init__(self, layout: BucketLayout):
        self.layout, self.topo = layout, layout.topo
        self.named, self.buckets = layout.named, layout.buckets
        self.flats = layout.allocate_flats() if self.zero_level < 2 else []
        if self.zero_level:
            layout.allocate_shards()
        self.sharded = None
        self.posted_early = 0
        for _, p in self.named:
            if self._hooked(p):
                p.register_post_accumulate_grad_hook(self._on_grad)

    # -- gradient hooks ----------------------------------------------------------------
    def _hooked(self, p: torch.Tensor) -> bool:
        """Whether ``p`` gets the post-accumulate hook: 16-bit parameters always (into the
        float32 main grad after every backward)."""
        return p.dtype in LOW

    def _on_grad(self, p: torch.Tensor) -> None:
        self._accumulate(p)

    def _accumulate(self, p: torch.Tensor) -> None:
        """Move a 16-bit microbatch gradient into the float32 main grad and free it."""
        if p.dtype in LOW:
            p.main_grad.add_(p.grad)
            p.grad = None

    # -- per step ----------------------------------------------------------------------
    def zero(self) -> None:
        """Clear gradients before a step (flat buffers, shards, hook counters)."""
        for flat in self.flats:
            flat.zero_()
        for b in self.buckets:
            if b.shard is not None:
                b.shard.zero_()
            b.staging, b.posted, b.arrived = None, 0, 0
        self.posted_early = 0
        for _, p in self.named:
            if self.zero_level >= 2 or p.dtype in LOW:
                p.grad = None

    def reduce(self) -> None:
        """Finish the step's reduction: sum every bucket over its group (:meth:`_sum`, the
        strategy) and, with HSDP, the shards across shard groups (:meth:`_across`), then sum
        sequence-parallel partial gradients over tp (sums over dp and tp commute). Collective
        over dp_comm, edp_comm and tp_comm."""
        self._sum()
        self._across()
        self._finish()

    @abc.abstractmethod
    def _sum(self) -> None:
        """Sum every bucket over its group (all-reduce in place, or reduce-scatter into the
        shards), in bucket order; nothing left in flight on return."""

    def _across(self) -> None:
        """HSDP: sum each reduced shard over its copies in the other shard groups (every copy
        then holds the gradient summed over the whole replica group). Collective over each
        bucket's ``replica`` group, in the wire dtype (``wire.py``) like the reduction before."""
        posted = []
        for b in self.buckets:
            if b.replica is not None and b.replica.size > 1:
                wire = self.layout.wire
                sent = outgoing(b.shard, b.replica, wire)
                posted.append((b, sent, b.replica.iallreduce_(sent, *op_for(sent, wire))))
        for b, sent, h in posted:
            h.wait()
            if sent is not b.shard:
                b.shard.copy_(sent)

    def _finish(self) -> None:
        if self.sharded is not None:  # zero 3: no gathered parameters outlive the step
            self.sharded.free_all()
        if self.zero_level:
            for b in self.buckets:
                for lo, hi in self.sp_ranges(b):
                    self.topo.tp_comm.allreduce_(b.shard[lo:hi])
        else:
            for p in self.layout.sp_params:
                self.topo.tp_comm.allreduce_(main_grad(p))

    def close(self) -> None:  # noqa: B027 (most strategies hold nothing beyond a step)
        """Release what the strategy holds beyond the step (a progress thread)."""

    # -- geometry and memory -------------------------------------------------------------
    def segments(self, b: Bucket):
        """See :meth:`BucketLayout.segments`."""
        return self.layout.segments(b)

    def sp_ranges(self, b: Bucket) -> list[tuple[int, int]]:
        return self.layout.sp_ranges(b)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now (flat buffers, staging, shards)."""
        n = sum(f.numel() * f.element_size() for f in self.flats)
        for b in self.buckets:
            for t in (b.shard, b.staging):  # (zero 3 parameters: ShardedParams)
                n += 0 if t is None else t.numel() * t.element_size()
        return n
