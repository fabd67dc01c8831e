"""Stage 1 (partition) and the communication each strategy inserts into the model.

- ``build.py``: :func:`build_model`, this rank's model chunks for any layout.
- ``tensor.py``: tensor and sequence parallelism (conjugate f/g autograd functions over
  ``tp_comm``, vocab-parallel cross-entropy).
- ``ring_attention.py``: context parallelism, ring attention over ``cp_comm`` (causal load
  balancing, log-sum-exp merge, key/value gradients returned around the ring).
- ``ulysses.py``: context parallelism as Ulysses (``topology.cp_kind``), an all-to-all of
  heads over ``cp_comm`` around plain attention, on the ring's token layout.
- ``hybrid.py``: the hybrid (``cp_kind = "hybrid"``): Ulysses inside groups of
  ``topology.cp_ulysses`` cp ranks, ring attention across them.
- ``pipeline.py``: which layers live on which (virtual) stage.
- ``moe_exchange.py``: expert parallelism, the token all-to-all over ``ep_comm``.
- ``grad_sync/``: gradients summed over ``dpcp_comm`` / ``edpcp_comm`` (dp, and cp when > 1)
  by one strategy behind one interface (:class:`~.grad_sync.GradSync`, chosen by
  ``grad_sync.build``): buckets blocking, nonblocking or overlapped, per parameter,
  hierarchical (within node, across nodes), ZeRO-1/2/3 shards.
"""

from importlib import import_module

__all__ = ["build_model", "named_parameters", "virtual_stages"]


def __getattr__(name: str):
    """``build.py``'s names, imported when first asked for: the config checks reach
    ``pipeline.placement`` without importing torch."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(".build", __name__), name)
