"""Document masks (``data.document_mask``): which document each token of a packed window
belongs to, and its position inside that document's part of the window.

A window of ``T + 1`` tokens starting at global offset ``s`` may hold the end of one
document, whole documents and the start of another. Its inputs (the first ``T`` tokens) get

- **ids** (T,): the document of each token, counted from the window's first document (0,
  1, ...): attention lets a query see a key only when both have the same id (and the key
  does not come later);
- **positions** (T,): ``offset - max(document start, s)``: 0 at each document start, and at
  the window's first token (a document cut by the window's start is treated as if it began
  there, as running that part alone would). Rotary positions are these.

Document starts come from the data: ``/train/doc_starts`` and ``/val/doc_starts`` of a
prepared file (where each document starts in its split's tokens; memory-mapped, not read
whole), or the lengths of the embedded corpus's documents. A file without them (prepared by
an older hpctrain) cannot be masked: :func:`problems` says so before any collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def ids_and_positions(starts: np.ndarray, seq_len: int,
                      doc_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, positions), each (len(starts), seq_len) int64, of the inputs of the windows
    beginning at global offsets ``starts``; ``doc_starts`` sorted increasing (tokens before
    the first start count as one document beginning at offset 0)."""
    starts = np.asarray(starts, dtype=np.int64)
    offsets = starts[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]
    doc = np.searchsorted(doc_starts, offsets, side="right") - 1  # -1: before the first
    began = np.where(doc >= 0, np.asarray(doc_starts[np.maximum(doc, 0)], np.int64), 0)
    positions = offsets - np.maximum(began, starts[:, None])
    return doc - doc[:, :1], positions


class Documents:
    """The ``documents`` callable of ``data.dataset.Sampler``: the starts of a microbatch's
    windows -> one (B, 2, T) int64 tensor, ``[:, 0]`` the ids and ``[:, 1]`` the positions of
    the whole windows (every cp rank gets all T: ring attention needs the ids and positions
    of the key/value blocks other ranks send)."""

    def __init__(self, doc_starts: np.ndarray, seq_len: int):
        self.doc_starts, self.T = doc_starts, seq_len  # a memory map stays one

    def __call__(self, starts: np.ndarray) -> torch.Tensor:
        import torch

        ids, pos = ids_and_positions(starts, self.T, self.doc_starts)
        return torch.from_numpy(np.stack([ids, pos], axis=1))


def doc_starts(path: str, split: str, corpus_mb: float = 2.0, val_fraction: float = 0.05,
               tokenizer: str = "", read: bool = True) -> np.ndarray | None:
    """Where each document of ``split`` starts in its tokens (int64, increasing): the file's
    ``SPLIT/doc_starts``, or the embedded corpus's document lengths; ``read=False``: only
    check that they are there (None). Raises ``DataError`` for a file without them. Every
    rank reads for itself (no collective)."""
    from . import dataset

    if not path:
        tok = dataset._tokenizer(tokenizer)
        lens = np.asarray([len(ids) for ids, key in
                           dataset._embedded_ids(int(corpus_mb * 2**20), tok)
                           if (key < val_fraction * 1_000_000) == (split == "val")],
                          dtype=np.int64)
        return np.cumsum(lens) - lens
    with dataset._open(path) as f:
        d = f.get(f"{split}/doc_starts")
        if d is None:
            raise dataset.DataError(
                f"data.path={path} has no {split}/doc_starts (prepared by an older hpctrain), "
                "so data.document_mask = true cannot tell where its documents start: prepare "
                "it again with `hpctrain prepare`, or set data.document_mask = false")
        return _mapped(d, path) if read else None


def _mapped(d, path: str) -> np.ndarray:
    """``d``'s elements as a read-only memory map when the file stores them contiguously
    (how ``hpctrain prepare`` writes them): a window's look-up touches a few pages, so a
    rank's memory does not grow with the number of documents. Else read whole."""
    from . import dataset

    plain = (d.chunks is None and d.dtype == np.dtype("<i8") and d.shape[0] > 0
             and d.id.get_create_plist().get_external_count() == 0)
    offset = d.id.get_offset() if plain else None
    if offset is None:
        return dataset._read(d, path).astype(np.int64)
    return np.memmap(path, dtype="<i8", mode="r", offset=offset, shape=d.shape)


def problems(path: str, splits, corpus_mb: float, val_fraction: float,
             tokenizer: str) -> list[str]:
    """Why the document starts of ``splits`` cannot be had ([] when they can)."""
    from .dataset import DataError

    try:
        for split in splits:
            doc_starts(path, split, corpus_mb, val_fraction, tokenizer, read=False)
    except DataError as e:
        return [str(e)]
    return []


def for_split(data_cfg, split: str, seq_len: int) -> Documents | None:
    """The sampler's ``documents`` for ``split`` when ``data.document_mask`` is on, else
    None."""
    d = data_cfg
    if not d.document_mask:
        return None
    return Documents(doc_starts(d.path, split, d.corpus_mb, d.val_fraction, d.tokenizer),
                     seq_len)
