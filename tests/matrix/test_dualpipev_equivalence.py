"""Invariant 1 and 4 for DualPipeV (``schedule.kind = "dualpipev"``) in one launch,
float64 against one rank at 1e-9: pp=4 composed with dp (8 microbatches per dp rank, the
fewest the schedule takes), saving at step 3 and resumed on one rank; pp=2 resumed from the
one-rank reference's step 3; pp=2 x dp=2 with experts over ep=2 whose all-to-alls run as
schedule actions (``schedule.moe_overlap``) beside the other microbatch's compute."""

import math

import pytest
from inprocess import baseline, train_layout
from launch import TINY, assert_same, assert_tail_equal, ckpt

from hpctrain.config import load, microbatches
from hpctrain.pipeline.schedules import from_config
from hpctrain.pipeline.simulate import simulate

KIND = 'schedule.kind="dualpipev"'
COMMON = ("train.steps=6", "checkpoint.every=3")  # test_checkpoint_reshard.py's reference
PP4 = ("topology.pp=4", "topology.dp=2", KIND)
MOE = ("model.num_experts=4", "model.moe_every=2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, session_dir):
    """(pp=4 x dp=2 run of 6 steps saving at 3, the one-rank reference)."""
    ref = baseline(session_dir, *COMMON)
    return train_layout(tmp_path_factory.mktemp("dpv") / "pp4", 8, *COMMON, *PP4), ref


def test_pp4_dp2_equals_one_rank(saved):
    run, ref = saved
    assert_same(run, ref, rel=1e-9, what="dualpipev pp=4 x dp=2")
    cfg = load(TINY, list(PP4))
    peak = simulate(from_config(cfg, microbatches(cfg))).peak_inflight
    assert peak == [9] * 4  # 2pp+1 chunk-microbatches on every rank (the DualPipe table)
    for m in run.metrics:
        assert m["pp_peak_inflight"] == peak and 0.0 <= m["pp_bubble_sim"] < 1.0, m


def test_saved_under_dualpipev_resumes_on_one_rank(tmp_path, saved):
    run, ref = saved
    b = train_layout(tmp_path / "one", 1, "train.steps=6", f"checkpoint.resume={ckpt(run, 3)}")
    assert_tail_equal(b, ref, 3, "dualpipev pp=4 x dp=2 -> 1 rank")


def test_one_rank_resumes_under_dualpipev(tmp_path, saved):
    _, ref = saved
    b = train_layout(tmp_path / "pp2", 2, "train.steps=6", "topology.pp=2", KIND,
                  f"checkpoint.resume={ckpt(ref, 3)}")
    assert_tail_equal(b, ref, 3, "1 rank -> dualpipev pp=2")


def test_experts_over_ep_with_overlapped_pairs_equal_one_rank(tmp_path, session_dir):
    ref = baseline(session_dir, *MOE, "train.micro_batch_size=2")  # its microbatch j: dp's
    run = train_layout(tmp_path / "moe", 4, *MOE, "topology.pp=2", "topology.dp=2",
                    "topology.ep=2", KIND, "schedule.moe_overlap=true")
    assert_same(run, ref, rel=1e-9, what="dualpipev pp=2 x dp=2 x ep=2, overlapped")
    for a, b in zip(run.metrics, ref.metrics):
        assert a["moe_load"] == b["moe_load"]
        assert math.isclose(a["moe_aux_loss"], b["moe_aux_loss"], rel_tol=1e-9)
    m = run.metrics[-1]
    assert m["moe_a2a_s"] > 0 and m["moe_a2a_s"] >= m["moe_a2a_exposed_s"] >= 0
