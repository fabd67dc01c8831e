"""Stage 5: collective checkpoints in parallel HDF5, whole or absent, any layout back.

- ``tiers.py``: :class:`Checkpoints`, what the training loop talks to: both tiers (the
  HDF5 file and the node-local generations) restored, saved when due, polled, waited for.
- ``checkpointer.py``: :class:`Checkpointer` (save: snapshot, then write now or in the background;
  restore: newest sound one, fallback on damage) and :func:`latest`.
- ``write.py``: the snapshot of this rank's bytes and the :class:`Writer` (create, fill,
  checksums from memory, fsync, verify if asked, rename, point ``latest``, prune).
- ``background.py``: ``checkpoint.async``: the writer thread, at most one save in flight,
  its end or failure agreed by all ranks.
- ``layout.py``: which hyperslab of each global dataset this rank owns (:class:`Piece`),
  and the transfer of pieces into and out of the file.
- ``integrity.py``: the format, CRC-32 per dataset, verification, the run's environment.
- ``lineage.py``: what a run was made from (data hash, config, resumed-from chain).
- ``trajectory.py``: the commit log: which files of the directory the run trains on
  (retention, fallback) and what a run starting elsewhere sets aside.
"""

from importlib import import_module

_HOME = {"Checkpointer": ".checkpointer", "CorruptCheckpoint": ".checkpointer",
         "latest": ".checkpointer", "Checkpoints": ".tiers"}
__all__ = list(_HOME)


def __getattr__(name: str):
    """``checkpointer.py``'s and ``tiers.py``'s names, imported when first asked for: the
    input checks read checkpoints (``integrity``) without importing torch."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOME[name], __name__), name)
