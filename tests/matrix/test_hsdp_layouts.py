"""HSDP (``optim.zero`` 1-3 with ``topology.shard_within``) in one launch, float64:
state sharded inside shard groups of 2 of the dp x cp replicas and replicated across them
trains the same model as one rank (invariant 1, rel <= 1e-9) with tp + sequence parallelism,
cp, ep and pp; its checkpoint continues on a plain layout and a plain one as HSDP. The
refusals and ``shard_within = "node"`` on two simulated nodes run through the CLI
(tests/e2e/test_hsdp.py)."""

import pytest
from inprocess import baseline, train_layout
from launch import (
    assert_about_one_dp,
    assert_same,
    assert_sharded_and_replicated,
    assert_state_same,
    rel_err,
)

SHARD2 = 'topology.shard_within="2"'
MOE = ("model.num_experts=4", "model.moe_every=2")  # as test_cp_equivalence.py
FIXED = ("optim.decay_steps=5",)  # the learning-rate schedule of the 5-step run


def assert_only_step(run, ref, step: int) -> None:
    """``run`` resumed and trained step ``step`` alone, with the reference's loss and norm."""
    assert [m["step"] for m in run.metrics] == [step], f"not resumed at step {step}"
    assert rel_err(run.losses, ref.losses[step - 1:step]) <= 1e-9
    assert rel_err(run.grad_norms, ref.grad_norms[step - 1:step]) <= 1e-9


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    """zero=3, dp=4 in shard groups of 2, 5 steps, saving at step 3."""
    return train_layout(tmp_path_factory.mktemp("hsdp") / "dp4", 4, "topology.dp=4", SHARD2,
                     "optim.zero=3", "checkpoint.every=3", *FIXED)


def test_hsdp_zero3_equals_one_rank(dp4, session_dir):
    ref = baseline(session_dir)
    assert_same(dp4, ref, rel=1e-9, what="hsdp dp4")
    assert_state_same(dp4, ref, "hsdp dp4")
    assert_about_one_dp(dp4, ref, 2, "hsdp dp4: state over the shard group of 2, not dp=4")
    assert_sharded_and_replicated(dp4)
    log = (dp4.run_dir / "train.log").read_text()
    assert "HSDP: ZeRO-3 state sharded over 2 ranks (shard_within='2'), 2 replicas" in log, log


def test_hsdp_checkpoints_continue_on_any_layout(dp4, tmp_path, session_dir):
    """The HSDP step-3 file: zero=0 on one rank trains step 4; that plain file: HSDP zero=1
    dp=4 x pp=2 trains step 5; every step, the final parameters and the optimizer state
    equal the one-rank run's."""
    ref = baseline(session_dir)
    saved = dp4.run_dir / "checkpoints" / "step_00000003.h5"
    one = train_layout(tmp_path / "dp1", 1, "train.steps=4", f"checkpoint.resume={saved}",
                    *FIXED)
    assert_only_step(one, ref, 4)
    saved = one.run_dir / "checkpoints" / "step_00000004.h5"
    last = train_layout(tmp_path / "pp2", 8, "topology.dp=4", "topology.pp=2", SHARD2,
                     "optim.zero=1", f"checkpoint.resume={saved}", *FIXED)
    assert_only_step(last, ref, 5)
    assert set(last.params) == set(ref.params)
    for name, value in ref.params.items():
        assert rel_err(last.params[name], value) <= 1e-9, name
    assert_state_same(last, ref, "hsdp dp4 -> zero=0 dp1 -> hsdp zero=1 dp4 x pp2")
    assert_sharded_and_replicated(last)


def test_hsdp_with_tp_cp_ep_equals_one_rank(tmp_path, session_dir):
    """zero=2, dp=2 x ep=2 x cp=2 x tp=2 (sequence parallel): dense state in shard groups of
    2 of the 4 dp x cp replicas, all-reduced across the 2 groups; the experts' 2 replicas
    (dp_outer x cp) form one shard group. Microbatches of 4 (every microbatch costs ring
    transfers per layer); the MoE reference takes the global microbatch (dp x 4) at once."""
    ref = baseline(session_dir, *MOE, "train.micro_batch_size=8")
    run = train_layout(tmp_path / "run", 8, *MOE, "topology.dp=2", "topology.ep=2",
                    "topology.cp=2", "topology.tp=2", "topology.sequence_parallel=true",
                    SHARD2, "optim.zero=2", "train.micro_batch_size=4")
    assert_same(run, ref, rel=1e-9, what="hsdp dp2 ep2 cp2 tp2")
    assert_sharded_and_replicated(run, "dpcp")
    assert all(m["comm_bytes"].get("edpcp-shard", 0) > 0 for m in run.metrics)
