"""Gradient synchronisation over the data-parallel groups (dp x cp, and edp x cp for experts):
one strategy object per way of summing gradients, behind one interface, chosen once at set-up.

- ``base.py``: :class:`GradSync`, the interface (``zero``, ``reduce``, ``close``, ``buckets``,
  ``segments``, ``grad_bytes``) and what every strategy shares.
- ``layout.py``: :class:`BucketLayout`, the one cut of parameters into buckets
  (:func:`cut`), their flat buffers and shards; :func:`main_grad`, :func:`shard_dtype`.
- ``factory.py``: :func:`build` (from the configuration), :func:`create` (from explicit
  choices), :func:`choose` (the table: configuration -> strategy).
- ``choice.py``: what the configuration asks: the reduction mode, overlap and its progress.
- ``wire.py``: what reductions carry (``optim.grad_comm_dtype``): the buffers' dtype, or a
  bfloat16 copy converted just before the collective and back after.
- ``posting.py``: nonblocking posts in one fixed order, from gradient hooks or after
  backward, and the progress modes (shared machinery, not a strategy).
- ``blocking.py``: :class:`BlockingBuckets`, one blocking all-reduce per bucket (default).
- ``nonblocking.py``: :class:`NonblockingBuckets` (posted after backward) and
  :class:`OverlappedBuckets` (posted from the gradient hooks).
- ``per_parameter.py``: :class:`PerParameter`, the naive baseline (comparisons only).
- ``hierarchical.py``: :class:`HierarchicalBuckets`, the two-level reduction (within a node,
  across nodes, within).
- ``sharded.py``: :class:`Zero1` and :class:`Zero2`, buckets reduce-scattered into shards.
- ``zero3.py``: :class:`Zero3`: parameters sharded over the replica group too, gathered per
  block.
"""

from .base import GradSync
from .factory import STRATEGIES, build, choose, create
from .layout import Bucket, BucketLayout, cut, main_grad, shard_dtype

__all__ = ["STRATEGIES", "Bucket", "BucketLayout", "GradSync", "build", "choose", "create",
           "cut", "main_grad", "shard_dtype"]
