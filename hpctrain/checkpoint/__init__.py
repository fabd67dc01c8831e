"""Stage 5: collective checkpoints in parallel HDF5, whole or absent, any layout back.

- ``store.py``: :class:`Checkpointer` (save: create, fill, checksum, fsync, rename, point
  ``latest``, prune; restore: newest sound one, fallback on damage) and :func:`latest`.
- ``layout.py``: which hyperslab of each global dataset this rank owns (:class:`Piece`),
  and the transfer of pieces into and out of the file.
- ``integrity.py``: the format, CRC-32 per dataset, verification, the run's environment.
- ``lineage.py``: what a run was made from (data hash, config, resumed-from chain).
"""

from .store import Checkpointer, CorruptCheckpoint, latest

__all__ = ["Checkpointer", "CorruptCheckpoint", "latest"]
