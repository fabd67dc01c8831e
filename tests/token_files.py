"""Prepared token files written directly with h5py (the layout ``hpctrain prepare`` writes,
without tokenizing): for the sampler's and the lazy reader's tests."""

from __future__ import annotations

import hashlib

import numpy as np


def write_token_file(path, train: np.ndarray, val: np.ndarray, chunks: bool = False) -> str:
    """A byte-level data file of ``train`` and ``val`` tokens (uint8); ``chunks``: both
    datasets chunked and gzip-compressed (the reader's fallback path)."""
    import h5py

    h = hashlib.sha256()
    with h5py.File(path, "w") as f:
        for split, tokens in (("train", train), ("val", val)):
            a = np.ascontiguousarray(tokens, dtype=np.uint8)
            h.update(a.tobytes())
            opts = {"chunks": (max(1, min(len(a), 4096)),), "compression": "gzip"} \
                if chunks else {}
            f.create_dataset(f"{split}/tokens", data=a, **opts)
            f.create_dataset(f"{split}/doc_starts", data=np.zeros(1, dtype=np.int64))
        f.attrs.update({"tokenizer": "bytes", "vocab_size": 256, "documents": 2,
                        "max_token_id": int(max(train.max(initial=0), val.max(initial=0))),
                        "val_fraction": 0.05, "content_hash": h.hexdigest()})
    return str(path)
