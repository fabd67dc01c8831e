"""ZeRO-1 and ZeRO-2: every bucket (padded to a multiple of the group size) is
reduce-scattered into this rank's gradient shard ``bucket.shard`` (float32, float64 for
float64 models); the reduced full gradient never exists. ``optim/zero.py`` updates the shards.

- :class:`Zero1` (``optim.zero = 1``): the flat buffer stays; each bucket is reduce-scattered
  after backward, one at a time, or posted from the gradient hooks with overlap (as
  ``nonblocking.OverlappedBuckets``).
- :class:`Zero2` (``optim.zero = 2``): no persistent flat buffer. A post-accumulate hook moves
  each microbatch's gradient into a per-bucket staging buffer (float32 for 16-bit models) and
  frees ``p.grad``; a bucket is reduce-scattered into its shard (and its staging freed) as
  soon as all its parameters have this microbatch's gradient. Microbatches are summed in the
  shard.
"""

from __future__ import annotations

import torch

from .layout import Bucket, shard_dtype
from .posting import PostedSync
from .wire import op_for, outgoing


class Zero1(PostedSync):
    """Reduce-scatter of the flat buffer's buckets into the shards."""

    name = "zero1"
    zero_level = 1

    def _send(self, b: Bucket) -> torch.Tensor:
        return b.flat

    def _start(self, b: Bucket, thread) -> tuple:
        send = outgoing(self._send(b), b.group, self.layout.wire)
        recv = torch.empty_like(b.shard, dtype=send.dtype)  # added to the shard after the wait
        op = op_for(send, self.layout.wire)
        h = thread.reduce_scatter(b.group, send, recv, *op) if thread is not None \
            else b.group.ireduce_scatter(send, recv, *op)
        return h, recv

    def _sum(self) -> None:
        if self.overlap:
            super()._sum()
            return
        for b in self.buckets:  # one reduction at a time, as the blocking buckets
            self._post(b)
            self._wait_all()


class Zero2(Zero1):
    """Per-microbatch staging buffers, reduce-scattered from the hooks (always overlapped)."""

    name = "zero2"
    zero_level = 2
    per_microbatch = True

    def __init__(self, layout, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, overlap=True, microbatches=microbatches, progress=progress)

    def _accumulate(self, p: torch.Tensor) -> None:
        b, off = self.layout.where[id(p)]
        if b.staging is None:
            b.staging = torch.zeros(b.numel, dtype=shard_dtype(b.dtype), device=p.device)
        b.staging[off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def _send(self, b: Bucket) -> torch.Tensor:
        send = b.staging if b.staging is not None else b.shard.new_zeros(b.numel)
        b.staging = None  # freed when the reduction completes
        return send
