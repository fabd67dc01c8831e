"""Every sample once per epoch in one launch, on any layout, resumed on another (float64).

A tiny prepared corpus of 40 samples per epoch (641 tokens, seq_len 16) and 6 steps of 16
samples: the run crosses two epoch boundaries. The one-rank run is the reference; dp=2 trains
the 6 steps straight (equal to it), and tp=2 resumes from dp=2's checkpoint at step 2 (epoch
0, 32 samples in) and must continue exactly: losses, grad norms, final parameters and
optimizer state within 1e-9 of the reference's.
"""

import numpy as np
import pytest
from inprocess import baseline, on_root, train_layout
from launch import assert_same, assert_tail_equal, ckpt, hpctrain, rel_err
from token_files import write_token_file


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    rng = np.random.default_rng(35)
    path = tmp_path_factory.mktemp("epochs") / "tiny.h5"
    return on_root(write_token_file, path, rng.integers(0, 256, 641), rng.integers(0, 256, 200))


@pytest.mark.slow(reason="three runs across two epoch boundaries, and inspect")
def test_epochs_cross_and_resume_on_another_layout(tmp_path, session_dir, tiny_corpus):
    common = (f"data.path={tiny_corpus}", "train.steps=6", "checkpoint.every=2",
              "train.eval_every=3")
    ref = baseline(session_dir, *common)
    assert "40 samples per epoch" in ref.stdout
    a = train_layout(tmp_path / "dp2", 2, *common, "topology.dp=2")
    assert_same(a, ref, rel=1e-9, what="dp=2 across two epoch boundaries")
    b = train_layout(tmp_path / "tp2", 2, *common, "topology.tp=2",
                  f"checkpoint.resume={ckpt(a, 2)}")
    assert_tail_equal(b, ref, 2, "dp=2 step 2 (mid-epoch) -> tp=2")
    val = [[m["val_loss"] for m in r.metrics if "val_loss" in m] for r in (ref, b)]
    assert len(val[0]) == len(val[1]) == 2 and rel_err(val[1], val[0]) <= 1e-9  # 3, 6
    assert all(m["data_s"] >= 0 for m in b.metrics)

    # Where the stream stood, recorded in every checkpoint and shown by inspect: 16
    # samples a step, 40 an epoch.
    import h5py

    for step, epoch, position in ((2, 0, 32), (4, 1, 24), (6, 2, 16)):
        with h5py.File(ckpt(b if step > 2 else a, step), "r") as f:
            assert (f.attrs["epoch"], f.attrs["epoch_position"]) == (epoch, position), step
    shown = on_root(lambda: hpctrain(["inspect", str(ckpt(b, 6))]).stdout)
    assert "epoch              2" in shown and "epoch_position     16" in shown, shown
