"""Invariant 1 in one launch: dp=2 and dp=4 train the same model as one rank."""

import pytest
from inprocess import baseline, train_layout
from launch import assert_same


@pytest.mark.parametrize("dp", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_dp_float64_equals_one_rank(tmp_path, session_dir, dp):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / f"dp{dp}", dp, f"topology.dp={dp}")
    assert_same(run, ref, rel=1e-9, what=f"dp={dp}")
    assert run.losses[-1] < run.losses[0]  # and it learns


def test_dp_float32_equals_one_rank(tmp_path, session_dir):
    ref = baseline(session_dir, "model.dtype=\"float32\"")
    run = train_layout(tmp_path / "dp2f32", 2, "topology.dp=2", "model.dtype=\"float32\"")
    assert_same(run, ref, rel=1e-4, what="dp=2 float32")


def test_dp_with_microbatch_accumulation(tmp_path, session_dir):
    # micro_batch_size 2 on dp=2: 4 microbatches per rank accumulate in place.
    ref = baseline(session_dir)
    run = train_layout(tmp_path / "mb2", 2, "topology.dp=2", "train.micro_batch_size=2")
    assert_same(run, ref, rel=1e-9, what="dp=2 mbs=2")


@pytest.mark.parametrize("reduction", ["bucketed-nonblocking", "per-parameter"])
def test_dp_reduction_modes_equal_one_rank(tmp_path, session_dir, reduction):
    """``experimental.reduction`` changes how gradients travel, never what they sum to."""
    ref = baseline(session_dir)
    run = train_layout(tmp_path / reduction, 2, "topology.dp=2",
                    f'experimental.reduction="{reduction}"')
    assert_same(run, ref, rel=1e-9, what=f"dp=2 reduction={reduction}")
