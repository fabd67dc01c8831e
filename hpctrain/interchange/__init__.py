"""Checkpoints in and out of other formats, and generation (docs/interchange.md). Imports
``checkpoint``, ``config`` and ``model``; no MPI of its own.

- ``formats.py``: the registry of formats (Hugging Face, torch DCP, safetensors): detection,
  importer, exporter, ``init_from``; the CLI and the docs' table ask it.
- ``hf_map.py``: what maps to what (config fields, tensor names), what is refused.
- ``hf_export.py`` / ``hf_import.py``: a checkpoint as a Hugging Face directory and back.
- ``trainers.py``: other trainers' DCP checkpoints (``dcp.py`` the reader and writer,
  ``forms.py`` with ``titan.py`` and ``megatron.py`` their names, ``chunks.py`` coverage).
- ``pickles.py``: the pickles inside foreign checkpoints, read as data.
- ``init_from.py``: ``checkpoint.init_from``: a new run's parameters from either.
- ``generation.py``: sampling with a key/value cache (``hpctrain generate``), its benchmark.
"""


class InterchangeError(ValueError):
    """A model, file or directory that cannot be converted; the message says what, where and
    how to fix it. The CLI prints it and exits 2."""
