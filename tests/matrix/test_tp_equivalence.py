"""Invariant 1 for tensor (and sequence) parallelism, in one launch: tp, and dp x tp
layouts train the same model as one rank (losses, grad norms, final parameters in global
shape read back from the checkpoint each layout wrote)."""

import os

import pytest
from inprocess import baseline, train_layout
from launch import TINY, assert_same

SP = "topology.sequence_parallel=true"
F32 = 'model.dtype="float32"'

# (name, ranks, overrides): tp=2, tp=4, dp x tp = 2x2 and 4x2; sequence parallelism on and
# off alternate so that each mode runs at two tp sizes and with and without dp (the
# float32 and vocabulary cases below add one more of each). One launch per layout: the
# machine running CI is small.
LAYOUTS = [
    ("tp2", 2, ["topology.tp=2"]),
    ("tp4-sp", 4, ["topology.tp=4", SP]),
    ("dp2xtp2-sp", 4, ["topology.dp=2", "topology.tp=2", SP]),
    ("dp4xtp2", 8, ["topology.dp=4", "topology.tp=2"]),
]
# The other half of the matrix (each layout in the other mode): HPCTRAIN_TP_FULL=1 runs it
# too, where the machine has the cores for 4 more launches.
FULL = [
    ("tp2-sp", 2, ["topology.tp=2", SP]),
    ("tp4", 4, ["topology.tp=4"]),
    ("dp2xtp2", 4, ["topology.dp=2", "topology.tp=2"]),
    ("dp4xtp2-sp", 8, ["topology.dp=4", "topology.tp=2", SP]),
]
if os.environ.get("HPCTRAIN_TP_FULL") == "1":
    LAYOUTS += FULL


@pytest.mark.parametrize("name,n,overrides", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_tp_float64_equals_one_rank(tmp_path, session_dir, name, n, overrides):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / name, n, *overrides)
    assert_same(run, ref, rel=1e-9, what=name)
    # The tp collectives are recorded under their own axis (bytes: never a timing claim).
    assert all(m["comm_bytes"].get("tp", 0) > 0 for m in run.metrics), run.metrics[0]


def test_tp_float32_equals_one_rank(tmp_path, session_dir):
    # optim.eps=1e-6: with the default 1e-8 Adam turns float32 roundoff in a near-zero
    # gradient into an O(lr) step, and one element of blocks.6.mlp.w2 then differs by
    # 4.6e-4 (relative to the tensor's max) between one-rank float32 and one-rank float64
    # already, whatever the layout. A larger eps bounds that amplification, so the
    # comparison measures what tensor parallelism changes (measured here: 4e-5).
    common = (F32, "optim.eps=1e-6")
    ref = baseline(session_dir, *common)
    run = train_layout(tmp_path / "tp2-f32", 2, "topology.tp=2", *common)
    assert_same(run, ref, rel=1e-4, what="tp2 float32")


def test_vocab_not_divisible_by_tp(tmp_path, session_dir):
    # The smallest odd vocabulary that covers the data's largest token id (a smaller one is
    # refused before the run: tests/e2e/test_cli.py), so targets fall in both shards, the
    # last row included. Over tp=2: (V+1)/2 + (V-1)/2 rows and one padding row that must
    # never count, in the loss, the gradient norm, the update or the checkpoint (global
    # shape (V, C)). Tied embeddings send the head's gradient into the same padded table.
    from hpctrain.config import load
    from hpctrain.data.dataset import summarize

    data = load(TINY).data
    top = summarize(data.path, data.corpus_mb, data.val_fraction).max_id
    V = top + 1 if (top + 1) % 2 else top + 2
    common = (f"model.vocab_size={V}", "model.tie_embeddings=true")
    ref = baseline(session_dir, *common)
    assert ref.params["model/embed"].shape[0] == V and V % 2 == 1
    run = train_layout(tmp_path / f"v{V}", 2, "topology.tp=2", SP, *common)
    assert_same(run, ref, rel=1e-9, what=f"vocab {V} (largest id {top}), tp=2, sp")
