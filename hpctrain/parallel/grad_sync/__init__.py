"""Gradient synchronisation over the data-parallel groups (dp x cp, and edp x cp for experts).

- ``buffers.py``: :class:`GradBuffers`: gradients in buckets, summed (or reduce-scattered
  for ZeRO) over the replica groups.
- ``hierarchical.py``: the two-level reduction (within a node, across nodes, within).
- ``zero3.py``: ZeRO-3: parameters sharded over the replica group, gathered per block.
"""
