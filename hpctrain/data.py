"""Token data: byte-level preparation into HDF5, an embedded corpus, and a sampler whose
global batch for step ``s`` is the same whatever the layout.

Layout of a dataset file written by ``hpctrain prepare``::

    /train/tokens   uint8 or uint16 (N,)   documents concatenated
    /val/tokens     the held-out documents (chosen by a hash of each document, not by position)
    attrs: tokenizer, vocab_size, content_hash (sha256 of all tokens), documents, sources,
           val_fraction, created_by

Sampling (invariant 3): step ``s`` draws ``global_batch_size`` start offsets from a
generator seeded by ``(seed, s)``; sequence ``i`` of the global batch is
``tokens[start_i : start_i + T + 1]``. Global microbatch ``j`` is sequences
``[j*dp*mbs, (j+1)*dp*mbs)``; dp rank ``r`` takes ``mbs`` consecutive sequences of it.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TOKENIZER = "bytes"  # byte-level: token = byte value, vocabulary 256


def stdlib_documents(limit_bytes: int) -> list[tuple[str, bytes]]:
    """The embedded default corpus: Python's own standard-library sources, sorted by path,
    up to ``limit_bytes``. Found at run time, so nothing is downloaded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "test" in rel.split("/")[0]:
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        docs.append((rel, data))
        total += len(data)
        if total >= limit_bytes:
            break
    return docs


def is_validation(doc: bytes, val_fraction: float) -> bool:
    """A document's split depends on its content only (stable across re-preparation)."""
    h = int.from_bytes(hashlib.sha256(doc).digest()[:8], "little")
    return (h % 1_000_000) < val_fraction * 1_000_000


def split_documents(docs: list[bytes], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    train = [d for d in docs if not is_validation(d, val_fraction)]
    val = [d for d in docs if is_validation(d, val_fraction)]

    def cat(ds):
        return np.frombuffer(b"".join(ds), dtype=np.uint8).copy()

    return cat(train), cat(val)


def content_hash(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def read_sources(paths: list[str]) -> list[tuple[str, bytes]]:
    """Files, or every regular file below a directory, in sorted order."""
    out = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            out += [(str(f), f.read_bytes()) for f in sorted(p.rglob("*")) if f.is_file()]
        elif p.is_file():
            out.append((str(p), p.read_bytes()))
        else:
            raise FileNotFoundError(f"prepare: {s} is neither a file nor a directory")
    return out


def prepare(sources: list[str], out: str, val_fraction: float = 0.05) -> dict:
    """Write a dataset file from text files (byte-level tokens). Returns its attributes."""
    import h5py

    docs = read_sources(sources)
    if not docs:
        raise ValueError("prepare: no input documents")
    train, val = split_documents([d for _, d in docs], val_fraction)
    attrs = {
        "tokenizer": TOKENIZER, "vocab_size": 256, "content_hash": content_hash(train, val),
        "documents": len(docs), "val_fraction": val_fraction,
        "sources": "\n".join(name for name, _ in docs)[:60000],
        "created_by": "hpctrain prepare",
    }
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("train/tokens", data=train)
        f.create_dataset("val/tokens", data=val)
        f.attrs.update(attrs)
    tmp.replace(out)
    return attrs


@dataclass
class TokenSource:
    """Tokens of one split in memory, with the lineage of where they came from."""

    tokens: np.ndarray
    lineage: dict


def load_tokens(path: str, split: str = "train", corpus_mb: float = 2.0,
                val_fraction: float = 0.05) -> TokenSource:
    """The tokens of ``split`` from a prepared file, or from the embedded corpus when
    ``path`` is empty. Every rank reads for itself (read-only, no collective)."""
    if not path:
        docs = stdlib_documents(int(corpus_mb * 2**20))
        train, val = split_documents([d for _, d in docs], val_fraction)
        lineage = {"source": f"embedded: Python {sys.version.split()[0]} stdlib sources",
                   "tokenizer": TOKENIZER, "content_hash": content_hash(train, val),
                   "documents": len(docs), "val_fraction": val_fraction}
        return TokenSource(train if split == "train" else val, lineage)
    import h5py

    if not Path(path).is_file():
        raise FileNotFoundError(f"data.path={path} does not exist (make one with "
                                "`hpctrain prepare FILES --out DATA.h5`)")
    with h5py.File(path, "r") as f:
        if f"{split}/tokens" not in f:
            raise ValueError(f"{path} has no {split}/tokens dataset")
        tokens = f[f"{split}/tokens"][...]
        lineage = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    lineage["source"] = str(Path(path).resolve())
    return TokenSource(tokens, lineage)


class Sampler:
    """Deterministic, layout-independent batches.

    ``global_batch(step)`` -> (x, y) int64 tensors of shape (G, T); ``local(step)`` -> the
    list of this dp rank's microbatches [(x_j, y_j)], each (mbs, T).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, micro_batch: int,
                 dp_size: int, dp_rank: int, seed: int, device=None):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len+2 = "
                             f"{seq_len + 2}")
        self.tokens, self.T, self.G = tokens, seq_len, global_batch
        self.mbs, self.dp, self.r, self.seed = micro_batch, dp_size, dp_rank, seed
        self.microbatches = global_batch // (dp_size * micro_batch)
        self.device = device  # batches are moved there (the GPU of this rank)

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.T - 1, size=self.G)

    def _rows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        seq = torch.from_numpy(self.tokens[idx].astype(np.int64))
        if self.device is not None:
            seq = seq.to(self.device)
        return seq[:, :-1], seq[:, 1:]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.starts(step))

    def local(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        starts = self.starts(step)
        out = []
        for j in range(self.microbatches):
            lo = j * self.dp * self.mbs + self.r * self.mbs
            out.append(self._rows(starts[lo:lo + self.mbs]))
        return out
