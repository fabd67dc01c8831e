"""Every sample once per epoch, the same batch on every layout (invariant 3), read lazily."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from token_files import write_token_file

from hpctrain.data.dataset import TokenFile, load_tokens
from hpctrain.data.sampler import (
    EpochOrder,
    ReadAhead,
    Sampler,
    epochs_covered,
    samples_per_epoch,
)

FAST = settings(max_examples=60, deadline=None)


@FAST
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_an_epoch_order_is_a_permutation(n, seed, epoch):
    order = EpochOrder(n, seed, epoch)(np.arange(n))
    assert np.array_equal(np.sort(order), np.arange(n))


@FAST
@given(N=st.integers(18, 900), T=st.sampled_from([4, 8, 16]), G=st.sampled_from([1, 4, 6, 16]),
       seed=st.integers(0, 1000))
def test_every_sample_exactly_once_per_epoch(N, T, G, seed):
    """Steps over three epochs (G need not divide n): each epoch's n global samples are
    every sample once, the epochs come in different orders, and the windows are
    tokens[k*T : k*T + T + 1]."""
    tokens = np.arange(N, dtype=np.int64)
    s = Sampler(tokens, T, G, 1, 1, 0, seed)
    n = samples_per_epoch(N, T)
    assert n == (N - 1) // T == s.n
    steps = -(-3 * n // G)
    flat = np.concatenate([s.samples(step) for step in range(steps)])
    epochs = [flat[e * n:(e + 1) * n] for e in range(3)]
    for e in epochs:
        assert np.array_equal(np.sort(e), np.arange(n))
    if n >= 8:
        assert not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(s.starts(1), s.samples(1) * T)
    x, y = s.global_batch(1)
    assert torch.equal(x[:, 0], torch.from_numpy(s.starts(1)))
    assert torch.equal(y[:, -1], torch.from_numpy(s.starts(1) + T))
    assert s.position(steps) == {"epoch": steps * G // n, "epoch_position": steps * G % n}


def test_every_token_is_trained_on_once_per_epoch():
    """The coverage check: an epoch's whole steps train on every input token once, none
    twice, but the epoch's last n % G samples (the next step's) and the tail of fewer than T
    tokens (random windows with replacement left 37.6 % unseen). The token consecutive
    windows share is one's last target and the next one's first input."""
    N, T, G = 200_000, 128, 16
    s = Sampler(np.arange(N), T, G, 1, 1, 0, seed=1234)
    seen = np.zeros(N, dtype=np.int64)
    for step in range(s.n // G):
        for start in s.starts(step):
            seen[start:start + T] += 1
    steps = s.n // G  # the epoch's last n % G samples open the next step
    assert seen.max() == 1 and (seen == 1).sum() == steps * G * T
    assert (seen[s.n * T:] == 0).all()  # the tail of fewer than T tokens


@FAST
@given(dp=st.sampled_from([1, 2, 4, 8]), mbs=st.sampled_from([1, 2]),
       cp=st.sampled_from([1, 2, 4]), step=st.integers(0, 40), seed=st.integers(0, 99))
def test_the_batch_does_not_depend_on_dp_mbs_or_cp(dp, mbs, cp, step, seed):
    tokens = np.arange(700, dtype=np.int64) % 251
    G, T = 16, 8
    full_x, full_y = Sampler(tokens, T, G, 1, 1, 0, seed).global_batch(step)
    m = G // (dp * mbs)
    cols = [Sampler(tokens, T, G, mbs, dp, 0, seed, cp_size=cp, cp_rank=c).columns
            for c in range(cp)]
    rows = {}
    for r in range(dp):
        for c in range(cp):
            local = Sampler(tokens, T, G, mbs, dp, r, seed, cp_size=cp, cp_rank=c).local(step)
            assert len(local) == m
            for j, (x, y) in enumerate(local):
                whole = rows.setdefault((j, r), torch.full((mbs, T + 1), -1, dtype=torch.long))
                pos = torch.arange(T) if cols[c] is None else torch.from_numpy(cols[c])
                whole[:, pos], whole[:, pos + 1] = x, y
    rebuilt = torch.cat([rows[(j, r)] for j in range(m) for r in range(dp)])
    assert torch.equal(rebuilt[:, :-1], full_x) and torch.equal(rebuilt[:, 1:], full_y)


def test_epochs_covered():
    assert samples_per_epoch(1001, 100) == 10 and samples_per_epoch(5, 10) == 0
    assert epochs_covered(1001, 100, 4, 5) == 2.0


@pytest.mark.parametrize("chunks", [False, True])
def test_a_file_is_read_lazily_and_equals_the_array(tmp_path, chunks):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 256, 5000), rng.integers(0, 256, 300)
    path = write_token_file(tmp_path / "d.h5", train, val, chunks=chunks)
    src = load_tokens(path, "train")
    assert isinstance(src.tokens, TokenFile) and (src.tokens.offset is None) == chunks
    assert len(src.tokens) == 5000 and np.array_equal(src.tokens[10:20], train[10:20])
    a, b = Sampler(src.tokens, 16, 8, 2, 2, 1, 5), Sampler(train, 16, 8, 2, 2, 1, 5)
    for step in (0, 3, 40):
        assert all(np.array_equal(x, y) for x, y in zip(a.host(step), b.host(step)))
    assert np.array_equal(load_tokens(path, "val").tokens[0:300], val)


def test_read_ahead_returns_the_same_batches_and_raises_in_the_caller():
    s = Sampler(np.arange(3000) % 200, 8, 4, 2, 2, 0, seed=1)
    ahead = ReadAhead(s)
    for step in (0, 1, 2, 7, 8):  # 7: not the one read ahead
        got = ahead.get(step)
        assert all(torch.equal(g[0], w[0]) for g, w in zip(got, s.local(step)))
    ahead.close()

    class Broken(Sampler):
        def host(self, step):
            if step == 1:
                raise OSError("disk gone")
            return super().host(step)

    ahead = ReadAhead(Broken(np.arange(3000) % 200, 8, 4, 2, 2, 0, seed=1))
    ahead.get(0)
    with pytest.raises(OSError, match="disk gone"):
        ahead.get(1)
    ahead.close()


RSS = """
import sys
from hpctrain.data.dataset import load_tokens
from hpctrain.data.sampler import Sampler
s = Sampler(load_tokens(sys.argv[1]).tokens, 128, 64, 8, 2, 1, 1234)
for step in range(300):
    s.host(step)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of 300 steps' reads from a 5 MB and a 50 MB corpus: within 30 MB (reading
    the whole split would add 45 MB). The peak of the process's own memory (VmHWM: a
    child's ru_maxrss starts at its parent's)."""
    rng = np.random.default_rng(1)
    peaks = []
    for mb in (5, 50):
        path = write_token_file(tmp_path / f"{mb}.h5", rng.integers(0, 256, mb * 2**20,
                                                                    dtype=np.uint8),
                                np.zeros(1000, dtype=np.uint8))
        out = subprocess.run([sys.executable, "-c", RSS, path], capture_output=True,
                             text=True, check=True)
        peaks.append(int(out.stdout.split()[-1]) / 1024)
    assert peaks[1] < peaks[0] + 30, f"peak RSS {peaks[0]:.0f} MB -> {peaks[1]:.0f} MB"


def test_plan_says_how_many_epochs_the_run_covers(tmp_path, cli):
    from launch import TINY

    path = write_token_file(tmp_path / "d.h5", np.arange(641) % 256, np.arange(100) % 256)
    rc, out, err = cli("plan", TINY, "--world-size", "1", "--set", f"data.path={path}",
                       "--set", "train.steps=6")
    assert rc == 0, err
    assert f"this run covers 2.4 epochs of {path} (6 steps x 16 samples; 40 samples of 17 " \
        "tokens per epoch)" in out
    rc, out, _ = cli("plan", TINY, "--world-size", "1", "--set", "data.path=/elsewhere.h5")
    assert rc == 0 and "data: /elsewhere.h5 is not here (epochs not counted)" in out
