"""ZeRO-1/2 and overlapped reduction in one launch (tiny preset, float64, 5 steps).

ZeRO changes where the optimizer state lives and how gradients are summed, never the model:
losses, gradient norms, final parameters and the checkpointed optimizer state equal the
one-rank run (invariant 1, rel <= 1e-9), and each rank holds 1/dp of the optimizer state.
"""

import h5py
import pytest
from inprocess import baseline, train_layout
from launch import TINY, assert_same, optim_state, read_params, rel_err

from hpctrain.config import load


def _bucket_bytes(run) -> float:
    """One gradient bucket of the tiny preset, the sharding's padding tolerance."""
    return load(TINY, []).optim.bucket_mb * 2**20


# ZeRO-1 at dp=4 with overlap, ZeRO-2 at dp=2 without, overlap alone at dp=2 (ZeRO-2 with
# tp, ZeRO-1 with pp and ZeRO-2 with ep follow): each stage and mode once, one launch each.
@pytest.mark.parametrize("zero,dp,overlap", [(1, 4, True), (2, 2, False), (0, 2, True)])
def test_zero_equals_one_rank(tmp_path, session_dir, zero, dp, overlap):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / "run", dp, f"topology.dp={dp}", f"optim.zero={zero}",
                    f"optim.overlap={str(overlap).lower()}")
    what = f"zero={zero} dp={dp} overlap={overlap}"
    assert_same(run, ref, rel=1e-9, what=what)
    # The checkpointed Adam moments (gathered from the shards) equal the one-rank state.
    ref_state, state = optim_state(ref), optim_state(run)
    assert set(state) == set(ref_state) and ref_state
    for name, value in ref_state.items():
        assert rel_err(state[name], value) <= 1e-9, (what, name)
    # Optimizer-state bytes on rank 0: the one-rank total divided by dp, within one bucket.
    base = ref.metrics[-1]["mem_optimizer"]
    here = run.metrics[-1]["mem_optimizer"]
    expect = base / dp if zero else base
    assert abs(here - expect) <= _bucket_bytes(run), (what, here, expect)
    # Overlap: buckets were posted from the gradient hooks, while backward still ran.
    early = [m["grad_buckets_posted_in_backward"] for m in run.metrics]
    assert all(e > 0 for e in early) if (overlap or zero == 2) else all(e == 0 for e in early)
    if zero == 2:  # no full gradient buffer survives the step: only the shard
        assert run.metrics[-1]["mem_grads"] <= ref.metrics[-1]["mem_grads"] / dp + \
            _bucket_bytes(run)


def test_zero_resume_continues_exactly(tmp_path, session_dir):
    """Save at step 3 under ZeRO-2 on 4 ranks; resume in a fresh run directory under ZeRO-1
    on 2 ranks: its first recorded step is 4 (a resume, not a restart) and steps 4-5, the
    final parameters and the optimizer state equal the one-rank run's."""
    ref = baseline(session_dir)
    first = train_layout(tmp_path / "first", 4, "topology.dp=4", "optim.zero=2", "train.steps=3",
                      "optim.decay_steps=5")
    assert [m["step"] for m in first.metrics] == [1, 2, 3]
    assert rel_err(first.losses, ref.losses[:3]) <= 1e-9
    saved = first.run_dir / "checkpoints" / "step_00000003.h5"
    run = train_layout(tmp_path / "resumed", 2, "topology.dp=2", "optim.zero=1", "train.steps=5",
                    "optim.decay_steps=5", f"checkpoint.resume={saved}")
    assert [m["step"] for m in run.metrics] == [4, 5], "not resumed at step 4"
    assert rel_err(run.losses, ref.losses[3:]) <= 1e-9, (run.losses, ref.losses)
    assert rel_err(run.grad_norms, ref.grad_norms[3:]) <= 1e-9
    assert set(run.params) == set(ref.params)
    for name, value in ref.params.items():
        assert rel_err(run.params[name], value) <= 1e-9, name
    ref_state, state = optim_state(ref), optim_state(run)
    assert set(state) == set(ref_state) and ref_state
    for name, value in ref_state.items():
        assert rel_err(state[name], value) <= 1e-9, name


def test_skipped_step_after_resume_keeps_the_loaded_state(tmp_path):
    """Resume under ZeRO-1, the first step is skipped (a poisoned gradient: the numeric
    guard applies no update), then saved: the file holds the loaded moments, bit for bit,
    not the shards as they were before the load."""
    z = ("topology.dp=2", "optim.zero=1")
    first = train_layout(tmp_path / "first", 2, *z, "train.steps=3")
    saved = first.run_dir / "checkpoints" / "step_00000003.h5"
    run = train_layout(tmp_path / "resumed", 2, *z, "train.steps=4", "checkpoint.every=1",
                    f"checkpoint.resume={saved}", 'experimental.faults="poison@0:4"')
    assert [(m["step"], m["skipped"]) for m in run.metrics] == [(4, True)], run.metrics
    after = run.run_dir / "checkpoints" / "step_00000004.h5"
    want, got = read_params(saved, ""), read_params(after, "")
    want.pop("rng/torch"), got.pop("rng/torch")
    assert set(got) == set(want) and any(k.startswith("optim/") for k in want)
    for name, value in want.items():
        assert (got[name] == value).all(), f"{name} changed across a skipped step"
    assert any((v != 0).any() for k, v in want.items() if k.endswith("exp_avg_sq"))
    with h5py.File(after, "r") as f:
        assert f.attrs["step"] == 4 and f.attrs["optim_step"] == 3


def test_zero2_with_tp(tmp_path, session_dir):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / "tp", 4, "topology.dp=2", "topology.tp=2", "optim.zero=2",
                    "topology.sequence_parallel=true")
    assert_same(run, ref, rel=1e-9, what="zero=2 dp=2 tp=2 sp")


def test_zero1_with_pp_overlap(tmp_path, session_dir):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / "pp", 4, "topology.dp=2", "topology.pp=2", "optim.zero=1",
                    "optim.overlap=true")
    assert_same(run, ref, rel=1e-9, what="zero=1 dp=2 pp=2 overlap")


def test_zero_with_ep_equals_one_rank(tmp_path, session_dir):
    """Experts shard over edp_comm, dense weights over dp_comm: ZeRO-2 on dp=4, ep=2 equals
    one rank (whose microbatch is the global one: micro_batch_size = dp, as in
    test_moe_equivalence.py, whose baseline this shares)."""
    moe = ("model.num_experts=4", "model.moe_every=2")
    ref = baseline(session_dir, *moe, "train.micro_batch_size=4")
    run = train_layout(tmp_path / "z2", 4, *moe, "topology.dp=4", "topology.ep=2", "optim.zero=2")
    assert_same(run, ref, rel=1e-9, what="zero=2 dp=4 ep=2")
