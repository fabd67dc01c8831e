"""Corpora that are already tokens, read without re-tokenizing (``hpctrain prepare --from``).

- ``nanogpt``: a flat ``.bin`` of uint16 token ids (nanoGPT's ``prepare.py``), or llm.c's
  form (``dev/data/data_common.py`` ``write_datafile``): a header of 256 little-endian int32
  (magic, version, token count, zeros), then the ids: magic 20240520 version 1 (GPT-2,
  uint16) or magic 20240801 version 7 (Llama-3, uint32). A file that starts like such a
  header (a date, :data:`LLMC_DATES`, then zeros from word 8) with another magic or version
  is refused.
  Documents are separated by an end-of-text id (``--eot``; by default GPT-2's 50256 for
  uint16 ids, Llama-3's ``<|begin_of_text|>`` 128000, which llm.c puts between documents,
  for uint32): a document ends with its end-of-text token, ids after the last one are the
  last document. An ``--eot`` the ids cannot hold is refused.
- ``megatron``: Megatron-LM's indexed dataset, ``PREFIX.bin`` (token ids) and ``PREFIX.idx``:
  the 9-byte magic ``MMIDIDX\\x00\\x00``, version (uint64, 1), dtype code (uint8: 1 uint8,
  2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), sequence count N and
  document count D (uint64), then int32 sequence lengths [N], int64 byte pointers into the
  .bin [N] and int64 document indices [D] (sequence index where each document starts, 0
  first, N last). A document is the concatenation of its sequences.

No MPI, imports nothing of hpctrain: :class:`TokenCorpus` says how many documents there are
and their sizes (every rank computes the same), ``document(i)`` reads one (memory-mapped,
so a rank reads only the documents it is given).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# llm.c's token files: magic -> (version, dtype of the ids, default end-of-text id, model)
LLMC = {20240520: (1, "<u2", 50256, "GPT-2"), 20240801: (7, "<u4", 128000, "Llama-3")}
LLMC_DATES = range(20230101, 20991232)  # first words taken for an llm.c magic (a date)
LLMC_HEADER = 1024  # bytes: 256 int32
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                   6: np.float64, 7: np.float32, 8: np.uint16}


class FormatError(ValueError):
    """A corpus file that does not follow its format: one line naming the file and why."""


@dataclass
class TokenCorpus:
    """Documents of a tokenized corpus: sequence ``j`` is ``tokens[starts[j]:ends[j]]``,
    document ``i`` the sequences ``doc_seqs[i]:doc_seqs[i+1]`` (one each for nanoGPT)."""

    name: str
    tokens: np.ndarray  # memory-mapped token ids
    starts: np.ndarray  # int64 per sequence
    ends: np.ndarray
    doc_seqs: np.ndarray  # int64, documents + 1
    eot: int | None = None  # the end-of-text id that separated the documents (nanoGPT)

    def __post_init__(self):
        lens = np.concatenate([[0], np.cumsum(self.ends - self.starts)])
        self.sizes = (lens[self.doc_seqs[1:]] - lens[self.doc_seqs[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    def document(self, i: int) -> np.ndarray:
        a, b = int(self.doc_seqs[i]), int(self.doc_seqs[i + 1])
        parts = [self.tokens[s:e] for s, e in zip(self.starts[a:b].tolist(),
                                                  self.ends[a:b].tolist())]
        doc = np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])
        if doc.dtype.kind == "i" and doc.size and int(doc.min()) < 0:
            raise FormatError(f"{self.name}: document {i} has a negative token id "
                              f"{int(doc.min())}")
        return doc


def read(kind: str, path: str, eot: int | None = None) -> TokenCorpus:
    """The documents of a corpus in format ``kind`` (a key of :data:`READERS`); ``eot``
    None: the end-of-text id the file implies (nanoGPT)."""
    if kind not in READERS:
        raise FormatError(f"--from {kind}: unknown format; valid: {', '.join(FORMATS)}")
    return READERS[kind](path, eot)


def read_nanogpt(path: str, eot: int | None) -> TokenCorpus:
    data = _memmap(path, np.uint8)
    offset, dtype, default = _llmc_header(path, data)
    eot = default if eot is None else eot
    if eot > np.iinfo(dtype).max:
        raise FormatError(f"{path}: --eot {eot} cannot occur among its {np.dtype(dtype).name} "
                          f"ids (at most {np.iinfo(dtype).max}); give the end-of-text id of "
                          "the tokenizer that wrote it")
    if (data.size - offset) % np.dtype(dtype).itemsize:
        raise FormatError(f"{path}: {data.size - offset} bytes of tokens is not a whole "
                          f"number of {np.dtype(dtype).name} ids (not a nanoGPT .bin?)")
    tokens = np.frombuffer(data, dtype, offset=offset)
    ends = np.flatnonzero(tokens == eot) + 1
    if not ends.size or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    ends = ends.astype(np.int64)
    keep = ends > starts
    return TokenCorpus(path, tokens, starts[keep], ends[keep],
                       np.arange(int(keep.sum()) + 1, dtype=np.int64), eot)


def _llmc_header(path: str, data: np.ndarray) -> tuple[int, str, int]:
    """(bytes before the ids, their dtype, the default end-of-text id): llm.c's header when
    the first word is a date and words 8 to 255 are zero (no nanoGPT text starts with 496
    ids 0), else none (nanoGPT: uint16, GPT-2's 50256)."""
    words = np.frombuffer(data[:LLMC_HEADER], "<i4") if data.size >= LLMC_HEADER else None
    if words is None or int(words[0]) not in LLMC_DATES or words[8:].any():
        return 0, "<u2", 50256
    magic, version, count = (int(x) for x in np.frombuffer(data[:12], "<i4"))
    known = "; ".join(f"{m} version {v} ({name}, {np.dtype(t).name} ids)"
                      for m, (v, t, _, name) in LLMC.items())
    if magic not in LLMC:
        raise FormatError(f"{path}: llm.c magic {magic} is not a token file's (known: "
                          f"{known})")
    want, dtype, eot, name = LLMC[magic]
    if version != want:
        raise FormatError(f"{path}: llm.c version {version} of magic {magic} is unknown "
                          f"(known: {known})")
    item = np.dtype(dtype).itemsize
    if data.size != LLMC_HEADER + item * count:
        raise FormatError(f"{path}: llm.c header says {count} tokens, the file holds "
                          f"{(data.size - LLMC_HEADER) / item:g} {name} ids")
    return LLMC_HEADER, dtype, eot


def read_megatron(prefix: str) -> TokenCorpus:
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx = _memmap(idx_path, np.uint8)
    head = bytes(idx[:34])
    if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
        raise FormatError(f"{idx_path}: no Megatron index magic MMIDIDX (not an indexed "
                          "dataset .idx?)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise FormatError(f"{idx_path}: index version {version}, only version 1 is known")
    if code not in MEGATRON_DTYPES or np.dtype(MEGATRON_DTYPES[code]).kind == "f":
        raise FormatError(f"{idx_path}: dtype code {code} is not an integer token type")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    need = 34 + 12 * n_seq + 8 * n_doc
    if idx.size < need:
        raise FormatError(f"{idx_path}: {idx.size} bytes, the header's {n_seq} sequences and "
                          f"{n_doc} document indices need {need} (truncated?)")
    lengths = np.frombuffer(idx, "<i4", n_seq, 34).astype(np.int64)
    pointers = np.frombuffer(idx, "<i8", n_seq, 34 + 4 * n_seq)
    doc_idx = np.frombuffer(idx, "<i8", n_doc, 34 + 12 * n_seq)
    data = _memmap(bin_path, np.uint8)
    _check_megatron(idx_path, bin_path, lengths, pointers, doc_idx, dtype, data.size)
    tokens = np.frombuffer(data, dtype.newbyteorder("<"))
    starts = pointers // dtype.itemsize
    ends = starts + lengths
    lens = np.concatenate([[0], np.cumsum(lengths)])
    full = np.flatnonzero(lens[doc_idx[1:]] > lens[doc_idx[:-1]])  # empty documents dropped
    bounds = np.concatenate([doc_idx[full], doc_idx[full[-1] + 1:][:1]]) if full.size else \
        np.zeros(1, dtype=np.int64)
    return TokenCorpus(prefix, tokens, starts, ends, bounds.astype(np.int64))


def _check_megatron(idx_path, bin_path, lengths, pointers, doc_idx, dtype, bin_size) -> None:
    n_seq = len(lengths)
    if (lengths < 0).any():
        raise FormatError(f"{idx_path}: a negative sequence length")
    if n_seq and ((pointers % dtype.itemsize).any() or (pointers < 0).any()
                  or int((pointers + lengths * dtype.itemsize).max()) > bin_size):
        raise FormatError(f"{idx_path}: sequence pointers outside {bin_path} ({bin_size} "
                          f"bytes of {dtype}) (truncated or another dataset's .bin?)")
    if (len(doc_idx) < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq
            or (np.diff(doc_idx) < 0).any()):
        raise FormatError(f"{idx_path}: document indices must rise from 0 to the sequence "
                          f"count {n_seq}")


def _memmap(path: str, dtype) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise FormatError(f"{path} {'is not a file' if p.exists() else 'does not exist'}")
    if p.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    try:
        return np.memmap(p, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise FormatError(f"{path} cannot be read: {e}") from None


# The corpus formats ``hpctrain prepare --from`` reads: name -> reader(path, eot). A new
# format is a reader function above and one line here.
READERS = {
    "nanogpt": read_nanogpt,
    "megatron": lambda prefix, eot: read_megatron(prefix),
}
FORMATS = tuple(READERS)
