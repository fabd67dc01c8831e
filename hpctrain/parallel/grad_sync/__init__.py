"""Gradient synchronisation over the data-parallel groups (dp x cp, and edp x cp for experts):
one strategy object per way of summing gradients, behind one interface, chosen once at set-up.

- ``interface.py``: :class:`GradSync`, the interface (``zero``, ``reduce``, ``close``,
  ``buckets``, ``segments``, ``grad_bytes``; and the planner's prices: ``memory``,
  ``dp_seconds`` ...); :class:`BucketLayout`, the one cut of parameters into buckets
  (:func:`cut`), their flat buffers and shards; :func:`main_grad`, :func:`shard_dtype`; what
  reductions carry (``optim.grad_comm_dtype``: :func:`wire_dtype`).
- ``buckets.py``: the zero-0 strategies, whole gradients all-reduced per bucket:
  :class:`BlockingBuckets` (the default), :class:`NonblockingBuckets`,
  :class:`OverlappedBuckets`, :class:`PerParameter` (the naive baseline),
  :class:`HierarchicalBuckets` (within a node, across nodes, within); and
  :class:`PostedSync`, nonblocking posts in one fixed order and their progress modes.
- ``sharded.py``: ZeRO, buckets reduce-scattered into shards: :class:`Zero1`,
  :class:`Zero2`, :class:`Zero3` (parameters sharded too, gathered per block).
- ``factory.py``: the registry (``TABLE``: one row per strategy), :func:`choose`,
  :func:`strategy_of` (the planner's), :func:`refusal` (the config checks'), :func:`create`,
  :func:`build`; what the configuration asks (reduction mode, overlap, progress). It imports
  neither torch nor MPI.

The names below are imported when first asked for, so that ``factory`` (the config checks)
loads without torch.
"""

from importlib import import_module

_WHERE = {"GradSync": "interface", "Bucket": "interface", "BucketLayout": "interface",
          "cut": "interface", "main_grad": "interface", "shard_dtype": "interface",
          "build": "factory", "choose": "factory", "create": "factory",
          "strategies": "factory", "strategy_of": "factory"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
