"""Tokenized corpora in other pipelines' formats, written with numpy/struct from their
published layouts (for tests/unit/test_formats.py and tests/e2e/test_data_cli.py)."""

from __future__ import annotations

import struct

import numpy as np

EOT = 50256  # GPT-2's <|endoftext|>
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_nanogpt(path, docs: list[list[int]], llmc: bool = False) -> None:
    """nanoGPT's prepare.py: each document's ids followed by the end-of-text id, uint16."""
    flat = np.array([t for d in docs for t in [*d, EOT]], dtype="<u2")
    with open(path, "wb") as f:
        if llmc:  # llm.c: 256 int32 header (magic, version, token count)
            header = np.zeros(256, dtype="<i4")
            header[:3] = [20240520, 1, flat.size]
            f.write(header.tobytes())
        f.write(flat.tobytes())


LLMC = {"gpt-2": (20240520, 1, "<u2"), "llama-3": (20240801, 7, "<u4")}  # magic, version, ids


def write_llmc(path, tokens: list[int], model: str = "llama-3", header: tuple = ()) -> None:
    """llm.c's write_datafile (dev/data/data_common.py): 256 int32 (magic, version, token
    count, zeros), then the ids as uint16 (gpt-2) or uint32 (llama-3); ``header`` replaces
    the first words (a damaged or unknown header)."""
    magic, version, dtype = LLMC[model]
    words = np.zeros(256, dtype="<i4")
    words[:3] = [magic, version, len(tokens)]
    words[:len(header)] = header
    with open(path, "wb") as f:
        f.write(words.tobytes())
        f.write(np.array(tokens, dtype=dtype).tobytes())


def write_megatron(prefix, docs: list[list[list[int]]], dtype=np.uint16) -> None:
    """Megatron's indexed dataset: PREFIX.bin (ids), PREFIX.idx (magic, version 1, dtype
    code, sequence and document counts, int32 lengths, int64 byte pointers, int64 document
    indices from 0 to the sequence count)."""
    seqs = [s for d in docs for s in d]
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1] * item]).astype("<i8")
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.array(s, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers[:len(seqs)].tobytes() + doc_idx.tobytes())


def write_jsonl(path, texts: list, key: str = "text", lines: dict | None = None) -> None:
    """One JSON record per line ({key: text, "id": i}); ``lines``: raw lines put in place of
    some records (line number from 1 -> bytes); compressed by the name's ``.gz``/``.zst``."""
    import gzip
    import json

    raw = [(lines or {}).get(i + 1) or json.dumps({key: t, "id": i}).encode() + b"\n"
           for i, t in enumerate(texts)]
    data = b"".join(raw)
    if str(path).endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif str(path).endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)


def write_parquet(path, texts: list, column: str = "text", rows_per_group: int = 3) -> None:
    """A Parquet file written by pyarrow itself: the column ``column`` and an ``id``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({column: pa.array(texts, type=pa.string()),
                      "id": pa.array(range(len(texts)), type=pa.int64())})
    pq.write_table(table, path, row_group_size=rows_per_group)
