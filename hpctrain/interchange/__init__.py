"""Models in and out: Hugging Face interchange and generation (docs/models.md).
Imports ``checkpoint``, ``config`` and ``model``; no MPI of its own.

- ``hf_map.py``: what maps to what (config fields, tensor names), what is refused.
- ``hf_export.py``: a checkpoint as a Hugging Face directory (``hpctrain export --format hf``).
- ``hf_import.py``: a Hugging Face directory as a checkpoint (``hpctrain import``).
- ``init_from.py``: ``checkpoint.init_from``: a new run's parameters from either.
- ``generation.py``: sampling with a key/value cache (``hpctrain generate``), its benchmark.
"""
