"""ZeRO-3 (parameters sharded too, gathered per block) in one launch, float64.

Sharding never changes the model: losses, gradient norms, final parameters and the Adam
moments equal the one-rank run (invariant 1, rel <= 1e-9) with dp, tp + sequence
parallelism, pp (1f1b, gpipe, and the split backward of zb-h1 and zbv) and ep; the checkpoint is
written from the shards and any layout continues it (zero=3 dp4 -> zero=0 dp1 -> zero=3
dp2); each rank keeps ~1/dp of the parameters, gradients and optimizer state. The
baselines are the ones test_zero.py and test_moe_equivalence.py use (one run per session).
"""

import pytest
from inprocess import baseline, train_layout
from launch import TINY, assert_about_one_dp, assert_same, assert_state_same, rel_err

from hpctrain.config import load
from hpctrain.planner import memory

MOE = ("model.num_experts=4", "model.moe_every=2")








@pytest.mark.parametrize("n,layout", [
    (2, ("topology.dp=2",)),
    (4, ("topology.dp=2", "topology.tp=2", "topology.sequence_parallel=true")),
    # pp with 1f1b runs in test_cp_equivalence.py (cp2 x pp2 x dp2 with ZeRO-3); zbv's split
    # backward is zb-h1's (B then W per block)
    (4, ("topology.dp=2", "topology.pp=2", 'schedule.kind="zbv"')),
    (2, (*MOE, "topology.dp=2", "topology.ep=2")),
], ids=["dp2", "dp2-tp2-sp", "dp2-pp2-zbv", "dp2-ep2"])
def test_zero3_equals_one_rank(tmp_path, session_dir, n, layout):
    moe = layout[0] == MOE[0]
    ref = baseline(session_dir, *MOE, "train.micro_batch_size=2") if moe else \
        baseline(session_dir)
    run = train_layout(tmp_path / "run", n, *layout, "optim.zero=3")
    what = " ".join(layout)
    assert_same(run, ref, rel=1e-9, what=what)
    assert_state_same(run, ref, what)
    if layout == ("topology.dp=2",):
        assert_about_one_dp(run, ref, 2, what)
        # gradients were reduce-scattered block by block while backward ran
        assert all(m["grad_buckets_posted_in_backward"] > 0 for m in run.metrics)


@pytest.mark.parametrize("kind", ["gpipe", "zb-h1"])
def test_zero3_pipeline_schedules_equal_one_rank(tmp_path, session_dir, kind):
    """gpipe (every forward, then every backward) and zb-h1 (B and a later W) under ZeRO-3,
    dp2 x pp2: the one-rank run's losses, norms, parameters and optimizer state (1e-9); at
    most two units gathered at once on a rank (the plan's ``memory.gathered``: a block and
    the next block, embedding or head)."""
    ref = baseline(session_dir)
    layout = ("topology.dp=2", "topology.pp=2", f'schedule.kind="{kind}"', "optim.zero=3")
    run = train_layout(tmp_path / "run", 4, *layout)
    assert_same(run, ref, rel=1e-9, what=kind)
    assert_state_same(run, ref, kind)
    _, at_once = memory.gathered(load(TINY, list(layout)))
    assert all(0 < m["mem_params_gathered"] <= at_once * 8 for m in run.metrics), (
        at_once * 8, [m["mem_params_gathered"] for m in run.metrics])


def test_zero3_checkpoints_continue_on_any_layout(tmp_path, session_dir):
    """zero=3 dp=4 trains 5 steps (saving at 3) = one rank; zero=0 on one rank resumes its
    step-3 file and trains step 4; zero=3 dp=2 resumes that and trains step 5: every step,
    the final parameters and the optimizer state equal the one-rank run's."""
    ref = baseline(session_dir)
    fixed = ("optim.decay_steps=5",)  # the learning-rate schedule of the 5-step run
    first = train_layout(tmp_path / "dp4", 4, "topology.dp=4", "optim.zero=3",
                      "checkpoint.every=3", *fixed)
    assert_same(first, ref, rel=1e-9, what="zero=3 dp=4")
    assert_about_one_dp(first, ref, 4, "zero=3 dp=4")
    saved = first.run_dir / "checkpoints" / "step_00000003.h5"
    one = train_layout(tmp_path / "dp1", 1, "train.steps=4", f"checkpoint.resume={saved}",
                    *fixed)
    assert [m["step"] for m in one.metrics] == [4], "not resumed at step 4"
    assert rel_err(one.losses, ref.losses[3:4]) <= 1e-9
    assert rel_err(one.grad_norms, ref.grad_norms[3:4]) <= 1e-9
    saved = one.run_dir / "checkpoints" / "step_00000004.h5"
    last = train_layout(tmp_path / "dp2", 2, "topology.dp=2", "optim.zero=3",
                     f"checkpoint.resume={saved}", *fixed)
    assert [m["step"] for m in last.metrics] == [5], "not resumed at step 5"
    assert rel_err(last.losses, ref.losses[4:]) <= 1e-9
    assert rel_err(last.grad_norms, ref.grad_norms[4:]) <= 1e-9
    for name, value in ref.params.items():
        assert rel_err(last.params[name], value) <= 1e-9, name
    assert set(last.params) == set(ref.params)
    assert_state_same(last, ref, "zero=3 dp4 -> zero=0 dp1 -> zero=3 dp2")
