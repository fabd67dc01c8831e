"""Token data: corpora in, prepared files, the dataset and its sampler, tokenizers.

- ``dataset.py``: reading prepared HDF5 token files (lazily) and the embedded corpus.
- ``sampler.py``: the :class:`Sampler` (every sample once per epoch; a step's global batch is
  the same whatever the layout) and the read-ahead thread; ``segments.py``: document ids and
  positions of a window (``data.document_mask``); ``blend.py``: several files by weight
  (``data.sources``): which source each global sample comes from, one sampler per source.
- ``prepare.py``: ``hpctrain prepare``: documents -> one HDF5 token file, on any number of ranks;
  ``documents.py`` lists its inputs and reads JSONL, Parquet and text; ``spill.py`` writes.
- ``corpora.py``: corpora that are already tokens (nanoGPT / llm.c ``.bin``, Megatron-LM's
  indexed dataset), read without re-tokenizing.
- ``tokenizer.py``: byte-level tokens or a Hugging Face ``tokenizer.json``; training a BPE;
  which tokenizer belongs to a checkpoint or a data file.

No MPI of its own: ``prepare`` receives the world ``comm.Group`` from ``cli/prepare.py``.
"""
