"""Blending corpora (``data.sources``): the order (the table = the rule one sample after
another, every prefix within one sample of each share), each source's samples once per its
own epoch, the same batches on every layout, and the refusals before any collective."""

import dataclasses

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from token_files import write_token_file

from hpctrain.checks.inputs import data_problems
from hpctrain.checks.rules import problems
from hpctrain.config import ConfigError, load
from hpctrain.data import segments
from hpctrain.data.blend import BlendedSampler, BlendOrder, integer_weights, names, sequential
from hpctrain.data.sampler import Sampler

FAST = settings(max_examples=80, deadline=None)
weights = st.lists(st.integers(1, 60), min_size=1, max_size=7) | st.lists(
    st.sampled_from([0.05, 0.1, 0.25, 0.3, 0.5, 0.7, 1.5, 2.0]), min_size=1, max_size=5)


@FAST
@given(w=weights, start=st.integers(0, 10**12))
def test_the_table_is_the_rule_one_sample_after_another(w, start):
    """Over three periods the table gives each sample the source the sequential rule gives
    it and its index among that source's samples; far into the stream (``start``) the same,
    shifted by whole periods: a step's sources need nothing but the step."""
    order = BlendOrder(w)
    P = order.period
    seq = np.asarray(sequential(order.weights, 3 * P))
    src, idx = order(np.arange(3 * P))
    assert np.array_equal(src, seq)
    for i in range(len(w)):
        assert np.array_equal(idx[seq == i], np.arange((seq == i).sum()))
    g = start + np.arange(P)
    far_src, far_idx = order(g)
    assert np.array_equal(far_src, seq[g % P])
    assert np.array_equal(far_idx, order.counts(start)[far_src] + _running(far_src, len(w)))


def _running(src, k):
    """The index of each sample among the samples of its source within ``src``."""
    seen = np.zeros(k, dtype=np.int64)
    out = np.empty(len(src), dtype=np.int64)
    for j, i in enumerate(src):
        out[j], seen[i] = seen[i], seen[i] + 1
    return out


@FAST
@given(w=weights)
def test_every_prefix_holds_each_source_within_one_sample_of_its_share(w):
    """|count_i(N) - N W_i / P| <= 1 - 1/(2k - 2) < 1 for every prefix N of three periods,
    and the counts (closed form) are the prefix sums of the sequence."""
    order = BlendOrder(w)
    k, P = len(order.weights), order.period
    src = np.asarray(sequential(order.weights, 3 * P))
    counts = np.cumsum(np.eye(k, dtype=np.int64)[src], axis=0)
    N = np.arange(1, 3 * P + 1)[:, None]
    error = np.abs(counts * P - N * np.asarray(order.weights)[None, :])  # in units of 1/P
    bound = 1 - 1 / (2 * k - 2) if k > 1 else 0
    assert error.max() <= bound * P + 1e-9 and error.max() < P
    for n in (0, 1, P - 1, P, 2 * P + 1):
        assert np.array_equal(order.counts(n), counts[n - 1] if n else np.zeros(k))


def test_integer_weights_keep_simple_proportions():
    assert integer_weights([0.7, 0.3]) == [7, 3]
    assert integer_weights([7, 3]) == [7, 3]
    assert integer_weights([1, 1, 2]) == [1, 1, 2]
    # exactly the proportions asked: no share rounded up to a minimum, no two weights alike
    assert integer_weights([1, 1e-5]) == [100000, 1]
    assert integer_weights([1, 4e-5]) == [25000, 1]
    assert integer_weights([0.5, 0.25, 0.25]) == [2, 1, 1]
    with pytest.raises(ValueError, match="repeat only every 1,000,000,001 samples"):
        integer_weights([1.0, 1e-9])  # finer than the order can be: refused, not rounded
    counts = BlendOrder([1, 1e-5]).counts(100001)
    assert list(counts) == [100000, 1]
    assert list(BlendOrder([0.7, 0.3]).source) == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]


def _parts(sizes, T, G, mbs=1, dp=1, r=0, cp=1, c=0, seed=5, documents=None):
    return [Sampler(np.arange(n, dtype=np.int64) + 10_000 * i, T, G, mbs, dp, r, seed,
                    cp_size=cp, cp_rank=c, stream=i,
                    documents=documents[i] if documents else None)
            for i, n in enumerate(sizes)]


@FAST
@given(sizes=st.lists(st.integers(20, 200), min_size=1, max_size=3),
       w=st.lists(st.integers(1, 9), min_size=3, max_size=3), G=st.sampled_from([1, 4, 6]),
       seed=st.integers(0, 999))
def test_each_source_sees_every_sample_once_per_its_own_epoch(sizes, w, G, seed):
    """Source i's c-th sample is its own order of epoch c // n_i at c % n_i: over the
    steps, each source's samples in groups of n_i are each of its samples once, and each
    window is that source's tokens[k*T : k*T + T + 1]."""
    T = 4
    s = BlendedSampler(_parts(sizes, T, G, seed=seed), w[:len(sizes)])
    steps = 3 * sum(p.n for p in s.parts) // G + 1
    seen = [[] for _ in sizes]
    for step in range(steps):
        src, sample = s.picks(step)
        x, y = s.global_batch(step)
        for j, (i, k) in enumerate(zip(src, sample)):
            seen[i].append(k)
            assert x[j, 0].item() == 10_000 * i + k * T and y[j, -1].item() == x[j, 0] + T
    for i, p in enumerate(s.parts):
        for e in range(len(seen[i]) // p.n):
            assert sorted(seen[i][e * p.n:(e + 1) * p.n]) == list(range(p.n))


def test_a_source_has_its_own_order_and_one_file_keeps_its_keys():
    """Each source's order is keyed by (seed, source index, epoch), so two sources of the
    same size do not march in step; a plain sampler (no stream) keeps the (seed, epoch)
    keys of the one-file stream."""
    a, b = _parts([200, 200], 4, 8)
    assert not np.array_equal(a.order(0)(np.arange(a.n)), b.order(0)(np.arange(b.n)))
    plain = Sampler(np.arange(200, dtype=np.int64), 4, 8, 1, 1, 0, 5)
    want = np.random.default_rng([5, 2]).integers(0, 2**63, size=4, dtype=np.uint64)
    assert np.array_equal(plain.order(2).keys, want)


@pytest.mark.parametrize("dp,mbs,cp", [(2, 1, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1)])
def test_a_blended_batch_is_the_same_on_every_layout(dp, mbs, cp):
    """The local microbatches of every dp and cp rank put back together are the one-rank
    global batch, document ids and positions included (each source's own doc_starts)."""
    T, G, sizes = 8, 8, [150, 90]
    starts = [np.array([0, 13, 40, 77]), np.array([0, 5, 50])]
    docs = [segments.Documents(d, T) for d in starts]
    one = BlendedSampler(_parts(sizes, T, G, documents=docs), [2, 1])
    for step in (0, 3, 11):
        x, y = one.global_batch(step)
        src, sample = one.picks(step)
        full = torch.stack([docs[i](np.array([k * T]))[0] for i, k in zip(src, sample)])
        for c in range(cp):
            cols = one.parts[0].columns
            got_x, got_y, got_d = [], [], []
            for r in range(dp):
                s = BlendedSampler(_parts(sizes, T, G, mbs, dp, r, cp, c, documents=docs),
                                   [2, 1])
                cols = s.columns
                for j, (mx, my, md) in enumerate(s.local(step)):
                    got_x.append((j, r, mx))
                    got_y.append((j, r, my))
                    got_d.append((j, r, md))
            got_x = torch.cat([t for _, _, t in sorted(got_x, key=lambda e: e[:2])])
            got_y = torch.cat([t for _, _, t in sorted(got_y, key=lambda e: e[:2])])
            got_d = torch.cat([t for _, _, t in sorted(got_d, key=lambda e: e[:2])])
            want = slice(None) if cols is None else torch.from_numpy(cols)
            assert torch.equal(got_x, x[:, want]) and torch.equal(got_y, y[:, want])
            assert torch.equal(got_d, full)


def test_position_per_source():
    s = BlendedSampler(_parts([41, 21], 4, 4), [3, 1])  # 10 and 5 samples per epoch
    assert s.parts[0].n == 10 and s.parts[1].n == 5
    import json

    pos = json.loads(s.position(7)["blend_position"])  # 28 samples: 21 of a, 7 of b
    assert [(p["epoch"], p["epoch_position"]) for p in pos] == [(2, 1), (1, 2)]


def test_names_are_stems_made_unique():
    cfg = load(None, ['data.sources=[{path="x/a.h5", weight=1}, {path="y/a.h5", weight=1}, '
                      '{path="b.h5", weight=2}]'])
    assert names(cfg.data.sources) == ["a-0", "a-1", "b"]


# Refusals, before any collective: one message per rule.

def _blend(*entries, **more):
    items = ", ".join(f'{{path="{p}", weight={w}}}' for p, w in entries)
    return load(None, [f"data.sources=[{items}]", "train.seq_len=16",
                       *(f"{k}={v}" for k, v in more.items())])


def test_rules_refuse_weights_and_both_keys():
    assert any("data.sources[1].weight=0 must be > 0" in p
               for p in problems(_blend(("a.h5", 1), ("b.h5", 0)), 1))
    assert any("data.sources[0].weight=-1 must be > 0" in p
               for p in problems(_blend(("a.h5", -1)), 1))
    both = problems(_blend(("a.h5", 1), **{"data.path": '"c.h5"'}), 1)
    assert any("not both" in p for p in both), both
    with pytest.raises(ConfigError, match="array of tables"):
        load(None, ['data.sources=[{path="a.h5"}]'])


@pytest.fixture
def two_files(tmp_path):
    rng = np.random.default_rng(1)
    return [write_token_file(tmp_path / f"{n}.h5", rng.integers(0, 200, m),
                             rng.integers(0, 200, 60)) for n, m in (("a", 300), ("b", 120))]


def test_inputs_refuse_a_missing_source_a_small_one_and_another_tokenizer(tmp_path,
                                                                         two_files):
    a, b = two_files
    assert data_problems(_blend((a, 0.7), (b, 0.3))) == []
    missing = data_problems(_blend((a, 1), (str(tmp_path / "none.h5"), 1)))
    assert len(missing) == 1 and "data.sources[1].path=" in missing[0] \
        and "does not exist" in missing[0], missing
    small = data_problems(_blend((a, 1), (b, 1), **{"train.seq_len": 200}))
    assert any("data.sources[1].path=" in p and "fewer than seq_len+2" in p for p in small)
    with h5py.File(b, "a") as f:
        f.attrs.update({"tokenizer": "bpe-8k", "tokenizer_hash": "ab" * 32})
    other = data_problems(_blend((a, 1), (b, 1)))
    assert len(other) == 1 and "a blend needs one tokenizer" in other[0], other
    assert data_problems(_blend((a, 1), (str(tmp_path / "none.h5"), 1)), missing_ok=True) == []


def test_the_blend_lineage_names_each_source_and_hash(two_files):
    from hpctrain.data.blend import open_stream

    a, b = two_files
    d = _blend((a, 0.7), (b, 0.3)).data
    s, lin = open_stream(d, "train", 16, 4, 1, 1, 0, 3)
    _, same = open_stream(dataclasses.replace(_blend((a, 7), (b, 3)).data), "train", 16, 4, 1,
                          1, 0, 3)
    _, moved = open_stream(_blend((a, 0.5), (b, 0.5)).data, "train", 16, 4, 1, 1, 0, 3)
    assert lin["content_hash"] == same["content_hash"] != moved["content_hash"]
    assert a in lin["blend"] and b in lin["blend"] and s.names == ["a", "b"]


def test_a_changed_blend_is_refused_on_resume_unless_allowed(two_files):
    """The blend's content hash (each source's hash and weight) is the checkpoint's
    ``data_hash``: another weight is another stream, refused unless data.allow_changed."""
    from hpctrain.checkpoint.lineage import LineageError, check_resume
    from hpctrain.data.blend import open_stream

    a, b = two_files
    _, old = open_stream(_blend((a, 0.7), (b, 0.3)).data, "train", 16, 4, 1, 1, 0, 3)
    _, new = open_stream(_blend((a, 0.6), (b, 0.4)).data, "train", 16, 4, 1, 1, 0, 3)
    attrs = {"step": 2, "data_hash": old["content_hash"]}
    assert check_resume(attrs, old["content_hash"], False, print) is None
    with pytest.raises(LineageError, match="data.allow_changed"):
        check_resume(attrs, new["content_hash"], False, print)
    forced = check_resume(attrs, new["content_hash"], True, print)
    assert forced == {"from": old["content_hash"], "to": new["content_hash"]}


def test_a_changed_weight_is_a_changed_blend_and_too_fine_ones_are_refused():
    """The blend's hash follows the weights as given ([1, 4e-5] is not [1, 1e-5]; 0.7/0.3 is
    7/3), and the config checks refuse weights finer than the order can hold."""
    from dataclasses import replace

    from hpctrain.checks.rules import problems
    from hpctrain.config import load
    from hpctrain.config.values import Source
    from hpctrain.data.blend import blend_lineage

    lin = [{"content_hash": "a", "source": "x"}, {"content_hash": "b", "source": "y"}]

    def hash_of(*w):
        return blend_lineage([Source(p, x) for p, x in zip("xy", w)], lin)["content_hash"]

    assert hash_of(1, 1e-5) != hash_of(1, 4e-5) and hash_of(0.7, 0.3) == hash_of(7, 3)
    cfg = load(None)
    cfg = replace(cfg, data=replace(cfg.data, sources=(Source("x.h5", 1.0), Source("y.h5", 1e-9))))
    assert any("repeat only every 1,000,000,001 samples" in p for p in problems(cfg, 1))
