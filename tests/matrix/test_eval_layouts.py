"""The held-out loss on layouts whose validation pass crosses ranks equals one rank's (1e-9),
and ``hpctrain generate`` reads each multi-rank checkpoint on one process."""

import pytest
from inprocess import baseline, on_root, train_layout
from launch import hpctrain, rel_err

EVAL = ("train.eval_every=5", "data.val_fraction=0.2")


def val_losses(run):
    return [m["val_loss"] for m in run.metrics if "val_loss" in m]


# Layouts whose validation pass crosses ranks: tp x pp with SP, interleaved pp, the V of
# zbv; the MoE case below runs dp=2 x ep=2 (validation batches split over dp, reduced).
LAYOUTS = [
    ("tp2_pp2_sp", 4, ["topology.tp=2", "topology.pp=2", "topology.sequence_parallel=true"]),
    ("pp2_interleaved", 2, ["topology.pp=2", "schedule.kind=\"interleaved\"",
                            "schedule.virtual_stages=2"]),
    # the V: the loss is on pp rank 0, rank 1 passes the middle activation to itself
    ("pp2_zbv", 2, ["topology.pp=2", "schedule.kind=\"zbv\""]),
]


@pytest.mark.parametrize("name,n,layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_validation_loss_equals_one_rank(tmp_path, session_dir, name, n, layout):
    ref = baseline(session_dir, *EVAL)
    run = train_layout(tmp_path / name, n, *layout, *EVAL)
    assert len(val_losses(ref)) == 1 and val_losses(run)
    assert rel_err(val_losses(run), val_losses(ref)) <= 1e-9, (val_losses(run), val_losses(ref))
    # generate from this multi-rank checkpoint, on one process
    out = on_root(lambda: hpctrain(["generate", str(tmp_path / name / "checkpoints"), "--prompt",
                                    "def ", "--tokens", "20", "--temperature", "0"]).stdout)
    assert out.startswith("def ") and len(out) > 10


# the expert all-to-alls as schedule actions: evaluation runs the expanded forward-only schedule
OVERLAP_PP = ("topology.pp=2", "schedule.kind=\"1f1b\"", "schedule.moe_overlap=true")


@pytest.mark.parametrize("name,n,extra", [("ep2", 2, ()), ("ep2_pp2_overlap", 4, OVERLAP_PP)],
                         ids=["ep2", "ep2_pp2_overlap"])
def test_validation_loss_with_experts(tmp_path, session_dir, name, n, extra):
    moe = ("model.num_experts=4", "model.top_k=2")
    # MoE balance statistics are per global microbatch: one rank takes the dp ranks'
    # microbatches together (micro_batch_size = dp * 1) to see the same groups.
    ref = baseline(session_dir, *EVAL, *moe, "train.micro_batch_size=2")
    run = train_layout(tmp_path / name, n, "topology.dp=2", "topology.ep=2", *extra, *EVAL, *moe)
    assert rel_err(val_losses(run), val_losses(ref)) <= 1e-9
