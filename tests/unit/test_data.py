"""The sampler's global batch does not depend on the layout (invariant 3); prepare works."""

import numpy as np
import pytest
import torch

from hpctrain.data.dataset import (
    DataError,
    Sampler,
    fit_problems,
    is_validation,
    load_tokens,
    stdlib_documents,
    summarize,
)
from hpctrain.data.prepare import prepare as prepare_source
from hpctrain.data.prepare import text_source
from hpctrain.data.tokenizer import byte_level


def prepare(paths: list[str], out: str, val_fraction: float = 0.05) -> dict:
    """Byte-level preparation in this process (serial HDF5), as `hpctrain prepare --binary`
    does (the files of these tests hold any byte)."""
    return prepare_source(text_source(paths, binary=True), byte_level(), out, val_fraction)

TOKENS = np.arange(5000, dtype=np.int64) % 251


@pytest.mark.parametrize("dp,mbs", [(1, 1), (2, 1), (4, 2), (8, 1), (2, 4)])
def test_dp_slices_tile_the_global_batch(dp, mbs):
    G, T = 16, 8
    full_x, full_y = Sampler(TOKENS, T, G, 1, 1, 0, seed=3).global_batch(step=5)
    m = G // (dp * mbs)
    pieces = {}  # global microbatch j -> rows from every dp rank in rank order
    for r in range(dp):
        local = Sampler(TOKENS, T, G, mbs, dp, r, seed=3).local(step=5)
        assert len(local) == m
        for j, (x, y) in enumerate(local):
            assert x.shape == (mbs, T) and torch.equal(y[:, :-1], x[:, 1:])
            pieces.setdefault(j, []).append(x)
    rebuilt = torch.cat([torch.cat(pieces[j]) for j in range(m)])
    assert torch.equal(rebuilt, full_x)
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])


def test_steps_differ_and_repeat():
    s = Sampler(TOKENS, 8, 4, 1, 1, 0, seed=1)
    assert not torch.equal(s.global_batch(0)[0], s.global_batch(1)[0])
    assert torch.equal(s.global_batch(7)[0], Sampler(TOKENS, 8, 4, 1, 1, 0, 1).global_batch(7)[0])


def test_too_little_data():
    with pytest.raises(ValueError, match="fewer than seq_len"):
        Sampler(TOKENS[:5], 8, 4, 1, 1, 0, seed=1)


def test_embedded_corpus_is_deterministic():
    a = load_tokens("", "train", corpus_mb=0.2)
    b = load_tokens("", "train", corpus_mb=0.2)
    assert a.lineage["content_hash"] == b.lineage["content_hash"]
    assert len(a.tokens) > 100_000 and a.tokens.dtype == np.uint8
    assert len(stdlib_documents(1)) == 1


def test_prepare_roundtrip_and_split_by_document(tmp_path):
    docs = [f"document number {i}\n".encode() * (i + 1) for i in range(200)]
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(docs):
        (src / f"d{i:03d}.txt").write_bytes(d)
    out = tmp_path / "data.h5"
    attrs = prepare([str(src)], str(out), val_fraction=0.2)
    assert attrs["documents"] == 200
    train, val = load_tokens(str(out), "train"), load_tokens(str(out), "val")
    n_val = sum(is_validation(d, 0.2) for d in docs)
    assert 10 < n_val < 80  # about 20 % of documents, chosen by content
    assert len(val.tokens) == sum(len(d) for d in docs if is_validation(d, 0.2))
    assert len(train.tokens) + len(val.tokens) == sum(len(d) for d in docs)
    assert train.lineage["content_hash"] == attrs["content_hash"]
    # Re-preparing the same files gives the same split and hash.
    assert prepare([str(src)], str(tmp_path / "again.h5"), 0.2)["content_hash"] == \
        attrs["content_hash"]


def test_prepare_missing_source(tmp_path):
    with pytest.raises(DataError, match="nope.txt is neither a file nor a directory"):
        prepare([str(tmp_path / "nope.txt")], str(tmp_path / "x.h5"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no input documents"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "x.h5"))
    (tmp_path / "a.txt").write_text("text\n")
    with pytest.raises(DataError, match="cannot write"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "a.txt" / "x.h5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "empty"]


def test_load_missing_dataset_file(tmp_path):
    with pytest.raises(DataError, match="hpctrain prepare"):
        load_tokens(str(tmp_path / "none.h5"))


def _prepared(tmp_path, payload: bytes, name="data.h5") -> str:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i in range(20):
        (src / f"d{i:02d}.bin").write_bytes(payload + bytes([i]))
    out = tmp_path / name
    prepare([str(src)], str(out), val_fraction=0.2)
    return str(out)


def test_prepare_records_tokenizer_and_largest_id(tmp_path):
    path = _prepared(tmp_path, b"hello \xf0\x9f\x99\x82 world\n" * 50)
    import h5py

    with h5py.File(path, "r") as f:
        assert f.attrs["tokenizer"] == "bytes" and int(f.attrs["max_token_id"]) == 0xF0
    s = summarize(path)
    assert (s.tokenizer, s.max_id) == ("bytes", 0xF0)
    assert s.tokens["train"] + s.tokens["val"] == 20 * (len(b"hello \xf0\x9f\x99\x82 world\n")
                                                        * 50 + 1)


def test_a_file_without_the_attribute_is_read_for_its_largest_id(tmp_path):
    """Files prepared before max_token_id was recorded: computed from the tokens."""
    import h5py

    path = _prepared(tmp_path, bytes(range(256)) * 4)
    with h5py.File(path, "a") as f:
        del f.attrs["max_token_id"]
    assert summarize(path).max_id == 255
    assert "largest token id 255" in " ".join(fit_problems(summarize(path), 255, 16, 0))


def test_embedded_corpus_largest_id_is_computed_from_its_tokens():
    s = summarize("", corpus_mb=0.2)
    train, val = load_tokens("", "train", corpus_mb=0.2), load_tokens("", "val", corpus_mb=0.2)
    assert s.max_id == max(int(train.tokens.max()), int(val.tokens.max()))
    assert s.tokens == {"train": len(train.tokens), "val": len(val.tokens)}
    assert s.tokenizer == "bytes" and "embedded corpus" in s.where
    assert summarize("", corpus_mb=0.2) is s  # cached: validation does not read it again


def test_vocabulary_must_cover_the_data(tmp_path):
    path = _prepared(tmp_path, bytes(range(200)) * 4)
    s = summarize(path)
    assert fit_problems(s, 201, 16, 0) == []  # ids 0..199 plus the document numbers < 20
    (msg,) = fit_problems(s, 199, 16, 0)
    assert path in msg and "largest token id 199" in msg and "model.vocab_size=199" in msg
    assert "model.vocab_size >= 200" in msg
    assert fit_problems(s, 200, 16, 0) == []


def test_too_few_tokens_for_the_sequence_length(tmp_path):
    s = summarize(_prepared(tmp_path, b"ab"))
    (msg,) = fit_problems(s, 256, 64, 0)
    assert "train split has" in msg and "seq_len+2 = 66" in msg
    assert any("validation split" in m for m in fit_problems(s, 256, 16, 5))


def test_damaged_and_foreign_files_are_refused(tmp_path):
    import h5py

    good = _prepared(tmp_path, b"some text\n" * 200)
    data = open(good, "rb").read()
    cut = tmp_path / "truncated.h5"
    cut.write_bytes(data[: len(data) // 2])
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f.create_dataset("images", data=np.zeros((4, 4)))
    floats = tmp_path / "floats.h5"
    with h5py.File(floats, "w") as f:
        f.create_dataset("train/tokens", data=np.zeros(100))
        f.create_dataset("val/tokens", data=np.zeros(100))
    text = tmp_path / "text.h5"
    text.write_text("not hdf5 at all\n")
    for path, why in [(cut, "cannot be read as HDF5"), (foreign, "not an hpctrain data file"),
                      (floats, "integer token ids"), (text, "cannot be read as HDF5"),
                      (tmp_path / "none.h5", "does not exist")]:
        for call in (lambda p: summarize(str(p)), lambda p: load_tokens(str(p))):
            with pytest.raises(DataError) as e:
                call(path)
            assert str(path) in str(e.value) and why in str(e.value), str(e.value)
            assert "\n" not in str(e.value)
