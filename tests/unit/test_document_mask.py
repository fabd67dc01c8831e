"""Document masks (``data.document_mask``) without MPI: the ids and positions of packed
windows (``data/segments.py``), and the masked model: a window holding several documents
gives each document exactly what running that document alone gives (nothing leaks across a
boundary, positions restart), in float64, for the llama and gpt forms, with recompute and
split stages. The sampler hands every microbatch its windows' ids and positions."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.config import load
from hpctrain.data import segments
from hpctrain.data.dataset import Sampler
from hpctrain.model import DecoderStage, init_parameters
from hpctrain.model.steps import drive

TOL = dict(rtol=1e-12, atol=1e-12)


def naive(starts, T, doc_starts):
    """Token by token: the document of each offset, counted from the window's first; its
    position counted from its start or the window's, whichever is later."""
    ids, pos = np.zeros((len(starts), T), np.int64), np.zeros((len(starts), T), np.int64)
    for i, s in enumerate(starts):
        first = None
        for t in range(T):
            o = s + t
            d = max([j for j, a in enumerate(doc_starts) if a <= o], default=-1)
            first = d if first is None else first
            began = doc_starts[d] if d >= 0 else 0
            ids[i, t], pos[i, t] = d - first, o - max(began, s)
    return ids, pos


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.integers(1, 20),
       st.data())
def test_ids_and_positions_match_token_by_token(lengths, T, data):
    doc_starts = np.cumsum([0] + lengths[:-1])
    total = int(np.sum(lengths)) + T
    starts = np.array(data.draw(st.lists(st.integers(0, total - T), min_size=1, max_size=4)))
    ids, pos = segments.ids_and_positions(starts, T, doc_starts)
    want_ids, want_pos = naive(starts, T, list(doc_starts))
    assert (ids == want_ids).all() and (pos == want_pos).all()
    # positions restart exactly where the id changes, and only there
    assert ((pos[:, 1:] == 0) == (ids[:, 1:] != ids[:, :-1])).all()


def model(arch: str):
    m = load("share/configs/tiny-llama.toml" if arch == "llama" else
             "share/configs/tiny.toml").model
    return replace(m, dtype="float64", n_layers=2)


def stage_of(m, layers=None, first=True, last=True):
    s = DecoderStage(m, layers if layers is not None else range(m.n_layers), first, last)
    init_parameters([s], seed=5)
    return s


def doc_of(lengths_per_row):
    """(B, 2, T) ids and positions of windows cut into documents of the given lengths."""
    rows = []
    for lengths in lengths_per_row:
        ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
        pos = np.concatenate([np.arange(n) for n in lengths])
        rows.append(np.stack([ids, pos]))
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_window_of_documents_equals_each_document_alone(arch):
    m = model(arch)
    stage = stage_of(m)
    T = 16
    cuts = [[5, 11], [16], [3, 3, 10]]  # per row: the lengths of its documents
    x = torch.randint(0, m.vocab_size, (len(cuts), T), generator=torch.Generator().manual_seed(2))
    packed = drive(stage.hidden_steps(x, doc_of(cuts)))
    for row, lengths in enumerate(cuts):
        at = 0
        for n in lengths:
            alone = drive(stage.hidden_steps(x[row:row + 1, at:at + n]))
            torch.testing.assert_close(packed[row:row + 1, at:at + n], alone, **TOL)
            at += n
    # without the mask the second document does read the first
    plain = drive(stage.hidden_steps(x))
    assert (plain[0, 5:] - packed[0, 5:]).abs().max() > 1e-6
    # one document filling the window: the mask changes nothing
    torch.testing.assert_close(packed[1], plain[1], **TOL)


def test_loss_and_gradients_sum_over_documents():
    """The loss of a packed window (targets inside each document) and its gradients equal
    the sums over the documents run alone; with recompute too."""
    m = model("llama")
    x = torch.randint(0, m.vocab_size, (1, 17), generator=torch.Generator().manual_seed(4))
    inp, tgt = x[:, :16], x[:, 1:]
    alone = stage_of(m)
    loss = sum(alone(inp[:, a:b], tgt[:, a:b]) for a, b in ((0, 7), (7, 16)))
    loss.backward()
    for recompute in (False, True):
        packed = stage_of(replace(m, recompute=recompute))
        got = packed(inp, tgt, doc_of([[7, 9]]))
        got.backward()
        torch.testing.assert_close(got, loss, **TOL)
        for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_split_stages_take_the_documents_each():
    """Every pipeline stage needs the ids and positions, not only the first."""
    m = replace(model("llama"), n_layers=4)
    whole = stage_of(m)
    first, last = stage_of(m, range(2), True, False), stage_of(m, range(2, 4), False, True)
    x = torch.randint(0, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    doc = doc_of([[4, 12], [9, 7]])
    torch.testing.assert_close(last(first(x, None, doc), x, doc), whole(x, x, doc), **TOL)


def test_sampler_hands_out_ids_and_positions():
    tokens = np.arange(400) % 251
    doc_starts = np.array([0, 10, 37, 38, 120, 300])
    docs = segments.Documents(doc_starts, 16)
    s = Sampler(tokens, 16, 8, 2, 2, 1, seed=3, documents=docs)
    plain = Sampler(tokens, 16, 8, 2, 2, 1, seed=3)
    starts = s.starts(0)
    for j, ((x, y, d), (x0, y0)) in enumerate(zip(s.local(0), plain.local(0))):
        assert torch.equal(x, x0) and torch.equal(y, y0) and d.shape == (2, 2, 16)
        lo = j * 4 + 2
        ids, pos = segments.ids_and_positions(starts[lo:lo + 2], 16, doc_starts)
        assert (d[:, 0].numpy() == ids).all() and (d[:, 1].numpy() == pos).all()


def test_embedded_corpus_knows_its_documents():
    from hpctrain.data.dataset import load_tokens

    starts = segments.doc_starts("", "train", corpus_mb=0.2)
    n = len(load_tokens("", "train", corpus_mb=0.2).tokens)
    assert starts[0] == 0 and (np.diff(starts) > 0).all() and starts[-1] < n


def test_file_doc_starts_are_mapped_and_a_file_without_them_is_refused(tmp_path):
    import h5py

    from hpctrain.data.dataset import DataError

    path = tmp_path / "d.h5"
    want = np.array([0, 4, 9, 30], dtype=np.int64)
    with h5py.File(path, "w") as f:
        for split in ("train", "val"):
            f[f"{split}/tokens"] = np.zeros(40, np.uint8)
            f[f"{split}/doc_starts"] = want
    got = segments.doc_starts(str(path), "val")
    assert isinstance(got, np.memmap) and (got == want).all()
    d = segments.Documents(got, 8)(np.array([2, 26]))
    ids, pos = d[:, 0], d[:, 1]
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 1, 2], [0] * 4 + [1] * 4]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert segments.problems(str(path), ("train", "val"), 2.0, 0.05, "") == []
    with h5py.File(path, "a") as f:
        del f["val/doc_starts"]
    assert segments.problems(str(path), ("train",), 2.0, 0.05, "") == []
    (msg,) = segments.problems(str(path), ("train", "val"), 2.0, 0.05, "")
    assert "has no val/doc_starts" in msg and "hpctrain prepare" in msg
    with pytest.raises(DataError):
        segments.doc_starts(str(path), "val")
