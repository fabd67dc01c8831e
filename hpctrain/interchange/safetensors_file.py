"""Safetensors files written one tensor at a time, never held in memory.

The format (huggingface/safetensors, ``safetensors/src/tensor.rs``): 8 bytes, the header's
length as a little-endian u64; the header, JSON: ``__metadata__`` (str -> str) and for each
tensor its ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` into the bytes that
follow, which hold the tensors one after another without gaps (C order, little-endian). Every
shape and dtype is known before any value is read, so the header is written first and each
tensor's bytes are streamed after it, a block at a time, from wherever they come (an HDF5
dataset). The layout is the library's own (``serialize_to_file``): tensors ordered by dtype
alignment, largest first, then by name; the header padded with spaces to a multiple of 8
bytes, so that every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# torch dtype name -> safetensors dtype, in safetensors' order of alignment (Dtype's order)
DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "float16": "F16",
          "bfloat16": "BF16", "int32": "I32", "float32": "F32", "float64": "F64",
          "int64": "I64"}
ALIGNMENT = list(DTYPES.values())


@dataclass(frozen=True)
class Planned:
    """One tensor of a file to write: ``key``, its torch ``dtype`` and ``shape``, and
    ``blocks()``, which yields tensors (torch or numpy) of that dtype whose elements, one
    block after another, are the tensor's in C order."""

    key: str
    dtype: object
    shape: tuple
    blocks: Callable[[], Iterable]

    @property
    def code(self) -> str:
        return DTYPES[str(self.dtype).replace("torch.", "")]

    @property
    def nbytes(self) -> int:
        import torch

        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty(
            (), dtype=self.dtype).element_size()


def header(tensors: list[Planned], metadata: dict) -> tuple[bytes, list[Planned]]:
    """(the header's bytes, the tensors in the order their bytes follow it)."""
    order = sorted(tensors, key=lambda t: (-ALIGNMENT.index(t.code), t.key))
    head: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} \
        if metadata else {}
    offset = 0
    for t in order:
        head[t.key] = {"dtype": t.code, "shape": [int(n) for n in t.shape],
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8), order


def write_file(path: Path, tensors: list[Planned], metadata: dict) -> None:
    """Write ``tensors`` as the safetensors file ``path``: the header, then each tensor's
    blocks as ``blocks()`` makes them (one block in memory at a time). Written beside
    ``path`` as ``.NAME.tmp`` and renamed over it when complete, so a failure leaves no
    partial file; the file gets the mode any new file gets under the umask."""
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
        raise RuntimeError("safetensors files are written on little-endian machines only")
    head, order = header(tensors, metadata)
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(head)))
            fh.write(head)
            for t in order:
                _stream(fh, t)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _stream(fh, t: Planned) -> None:
    """Tensor ``t``'s bytes, block by block; exactly as many as the header announced."""
    import torch

    done = 0
    for block in t.blocks():
        block = torch.from_numpy(np.ascontiguousarray(block)) if isinstance(
            block, np.ndarray) else block.contiguous()
        if block.dtype != t.dtype:
            raise ValueError(f"{t.key}: a block of {block.dtype}, announced {t.dtype}")
        raw = block.reshape(-1).view(torch.uint8).numpy()
        fh.write(raw.data)
        done += raw.size
        del block, raw
    if done != t.nbytes:
        raise ValueError(f"{t.key}: {done} bytes written, {t.nbytes} announced")
