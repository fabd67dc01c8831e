"""The sampler's global batch does not depend on the layout (invariant 3); prepare works."""

import numpy as np
import pytest
import torch

from hpctrain.data import Sampler, is_validation, load_tokens, prepare, stdlib_documents

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
    with pytest.raises(FileNotFoundError):
        prepare([str(tmp_path / "nope.txt")], str(tmp_path / "x.h5"))


def test_load_missing_dataset_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="hpctrain prepare"):
        load_tokens(str(tmp_path / "none.h5"))
