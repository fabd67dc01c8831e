"""Reading tokenized corpora without re-tokenizing: nanoGPT/llm.c ``.bin`` files and Megatron-LM
indexed datasets, written here with numpy/struct from the published layouts; document
boundaries survive the round trip and into the prepared file; the blocks of parallel
prepare tile the documents (no MPI)."""

import struct

import h5py
import numpy as np
import pytest
from corpus_files import EOT, write_llmc, write_megatron, write_nanogpt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpctrain.data.corpora import FormatError, read
from hpctrain.data.dataset import DataError
from hpctrain.data.prepare import blocks, prepare, token_source

FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


DOC = st.lists(st.integers(0, EOT - 1), min_size=1, max_size=30)


@FAST
@given(docs=st.lists(DOC, min_size=1, max_size=12), llmc=st.booleans())
def test_nanogpt_documents_round_trip(tmp_path, docs, llmc):
    path = tmp_path / "t.bin"
    write_nanogpt(path, docs, llmc)
    corpus = read("nanogpt", str(path), EOT)
    assert [corpus.document(i).tolist() for i in range(len(corpus))] == [d + [EOT] for d in docs]
    assert corpus.sizes.tolist() == [len(d) + 1 for d in docs]


def test_nanogpt_text_after_the_last_end_of_text_is_a_document(tmp_path):
    path = tmp_path / "t.bin"
    np.array([5, 6, EOT, EOT, 7, 8], dtype="<u2").tofile(path)
    corpus = read("nanogpt", str(path), EOT)
    assert [corpus.document(i).tolist() for i in range(len(corpus))] == \
        [[5, 6, EOT], [EOT], [7, 8]]


LLAMA_BOS = 128000  # what llm.c's Llama-3 files put between documents


def test_llmc_llama3_files_are_read_as_uint32(tmp_path):
    """llm.c's Llama-3 form (magic 20240801, version 7, uint32 ids) keeps ids above 65535
    and its documents (split at <|begin_of_text|> unless --eot says otherwise); its GPT-2
    form (20240520, version 1, uint16) too."""
    docs = [[128000, 70000, 5], [9, 128255, 1], [300000]]
    write_llmc(tmp_path / "l.bin", [t for d in docs for t in [*d, LLAMA_BOS]])
    corpus = read("nanogpt", str(tmp_path / "l.bin"), None)
    assert corpus.tokens.dtype == np.uint32 and corpus.eot == LLAMA_BOS
    assert [corpus.document(i).tolist() for i in range(len(corpus))] == \
        [[LLAMA_BOS], [70000, 5, LLAMA_BOS], [9, 128255, 1, LLAMA_BOS], [300000, LLAMA_BOS]]
    src = token_source("nanogpt", str(tmp_path / "l.bin"), 5)
    attrs = prepare(src, None, str(tmp_path / "d.h5"), 0.0)
    assert attrs["max_token_id"] == 300000 and attrs["eot"] == 5
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert f["train/tokens"].dtype == np.uint32 and f["train/tokens"].shape == (10,)
        assert f["train/doc_starts"][...].tolist() == [0, 3]
    write_llmc(tmp_path / "g.bin", [1, 2, EOT, 3, EOT], "gpt-2")
    corpus = read("nanogpt", str(tmp_path / "g.bin"), None)
    assert corpus.tokens.dtype == np.uint16 and corpus.eot == EOT and len(corpus) == 2


def test_llmc_headers_and_end_of_text_ids_that_cannot_be_read_are_refused(tmp_path):
    cases = {
        "gpt-2 v2": ("gpt-2", (20240520, 2), "llm.c version 2"),
        "llama v1": ("llama-3", (20240801, 1), "llm.c version 1"),
        "eval file": ("gpt-2", (20240522, 1), "magic 20240522"),
        "model file": ("llama-3", (20240326, 3), "magic 20240326"),
        "count": ("llama-3", (20240801, 7, 9), "header says 9 tokens"),
    }
    for name, (model, header, why) in cases.items():
        write_llmc(tmp_path / "x.bin", list(range(300)), model, header)
        with pytest.raises(FormatError) as e:
            read("nanogpt", str(tmp_path / "x.bin"), None)
        assert why in str(e.value) and "x.bin" in str(e.value), (name, str(e.value))
    write_nanogpt(tmp_path / "n.bin", [[1, 2], [3]])
    with pytest.raises(FormatError, match="--eot 70000 .*uint16"):
        read("nanogpt", str(tmp_path / "n.bin"), 70000)
    write_llmc(tmp_path / "g.bin", [1, 2, 3], "gpt-2")
    with pytest.raises(FormatError, match="--eot 65536 .*uint16"):
        read("nanogpt", str(tmp_path / "g.bin"), 65536)
    write_llmc(tmp_path / "l.bin", [1, 2, 3], "llama-3")
    assert len(read("nanogpt", str(tmp_path / "l.bin"), 65536)) == 1
    doc = [9000, 318] + list(range(1, 600))  # a first word of 20849448 (a date): no header
    write_nanogpt(tmp_path / "d.bin", [doc])
    assert read("nanogpt", str(tmp_path / "d.bin"), None).document(0).tolist() == doc + [EOT]


@FAST
@given(docs=st.lists(st.lists(st.lists(st.integers(0, 30000), max_size=9), min_size=1,
                              max_size=4), min_size=1, max_size=8),
       dtype=st.sampled_from([np.uint16, np.int32, np.int64, np.uint8]))
def test_megatron_documents_round_trip(tmp_path, docs, dtype):
    if dtype == np.uint8:
        docs = [[[t % 256 for t in s] for s in d] for d in docs]
    write_megatron(tmp_path / "m", docs, dtype)
    corpus = read("megatron", str(tmp_path / "m"))
    want = [sum(d, []) for d in docs if sum(d, [])]  # empty documents carry no tokens
    assert [corpus.document(i).tolist() for i in range(len(corpus))] == want


def test_damaged_megatron_and_nanogpt_files_are_refused(tmp_path):
    write_megatron(tmp_path / "m", [[[1, 2, 3]], [[4, 5]]])
    idx = (tmp_path / "m.idx").read_bytes()
    cases = {
        "magic": (b"XXIDIDX\x00\x00" + idx[9:], None, "no Megatron index magic"),
        "version": (idx[:9] + struct.pack("<Q", 2) + idx[17:], None, "index version 2"),
        "dtype": (idx[:17] + b"\x06" + idx[18:], None, "dtype code 6 is not an integer"),
        "truncated": (idx[:40], None, "(truncated?)"),
        "short bin": (idx, b"\x01\x00", "sequence pointers outside"),
    }
    for name, (idx_bytes, bin_bytes, why) in cases.items():
        (tmp_path / "x.idx").write_bytes(idx_bytes)
        (tmp_path / "x.bin").write_bytes(bin_bytes or (tmp_path / "m.bin").read_bytes())
        with pytest.raises(FormatError) as e:
            read("megatron", str(tmp_path / "x"))
        assert why in str(e.value) and "x.idx" in str(e.value), (name, str(e.value))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(FormatError, match="not a whole number of uint16"):
        read("nanogpt", str(tmp_path / "odd.bin"), EOT)
    with pytest.raises(DataError, match="none.idx does not exist"):
        token_source("megatron", str(tmp_path / "none"), EOT)


@pytest.mark.parametrize("kind", ["nanogpt", "megatron"])
def test_prepared_file_keeps_document_boundaries_and_splits_by_content(tmp_path, kind):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, rng.integers(3, 40)).tolist() for _ in range(80)]
    if kind == "nanogpt":
        write_nanogpt(tmp_path / "c.bin", docs)
        src, want = token_source(kind, str(tmp_path / "c.bin"), EOT), [d + [EOT] for d in docs]
    else:
        write_megatron(tmp_path / "c", [[d[:2], d[2:]] for d in docs])
        src, want = token_source(kind, str(tmp_path / "c"), EOT), docs
    attrs = prepare(src, None, str(tmp_path / "d.h5"), val_fraction=0.25)
    from hpctrain.data.dataset import is_validation

    got = {"train": [], "val": []}
    with h5py.File(tmp_path / "d.h5", "r") as f:
        for split in got:
            toks, starts = f[f"{split}/tokens"][...], f[f"{split}/doc_starts"][...]
            ends = np.append(starts[1:], toks.size)
            got[split] = [toks[a:b].tolist() for a, b in zip(starts, ends)]
        assert f["train/tokens"].dtype == np.uint16
    held = [is_validation(np.array(d, dtype="<u4").tobytes(), 0.25) for d in want]
    assert got["val"] == [d for d, v in zip(want, held) if v]
    assert got["train"] == [d for d, v in zip(want, held) if not v]
    assert 5 < len(got["val"]) < 40
    top = max(max(d) for d in want)
    assert attrs["max_token_id"] == top and attrs["source_format"] == kind
    assert attrs["vocab_size"] == (EOT + 1 if kind == "nanogpt" else top + 1)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 1000), max_size=40), parts=st.integers(1, 9))
def test_blocks_tile_the_documents_in_order(sizes, parts):
    bl = blocks(np.array(sizes, dtype=np.int64), parts)
    assert len(bl) == parts and bl[0][0] == 0 and bl[-1][1] == len(sizes)
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(bl, bl[1:]))
