"""Every parallel feature's keys through the real CLI at least once: ``hpctrain train`` under
the launcher (mpirun, mpiexec or srun) trains the same model as ``hpctrain train`` on one rank
(float64: losses, grad norms and final parameters within 1e-9). The matrix of layouts and
combinations runs inside one launch (tests/matrix); these launches prove that the command
a user types reaches the same code with the same keys. Between them: dp, tp with sequence
parallelism, pp with the 1F1B, interleaved, ZB-V and DualPipeV schedules, selective
recompute, ZeRO-1/2/3 with overlap, HSDP, ep with the scheduled all-to-alls, and cp of the
ring, Ulysses and hybrid kinds."""

import pytest
from launch import assert_same, baseline, train_cli

pytestmark = pytest.mark.e2e

SP = "topology.sequence_parallel=true"
MOE = ("model.num_experts=4", "model.moe_every=2")

# (name, ranks, overrides, one-rank reference overrides)
LAYOUTS = [
    ("dp2-zero1-overlap", 2, ["topology.dp=2", "optim.zero=1", "optim.overlap=true"], []),
    ("tp2xpp2-sp-interleaved-selective", 4,
     ["topology.tp=2", "topology.pp=2", SP, 'schedule.kind="interleaved"',
      "schedule.virtual_stages=2", 'model.recompute="selective"'], []),
    ("cp2xpp2xdp2-zbv-zero3", 8,
     ["topology.cp=2", "topology.pp=2", "topology.dp=2", 'schedule.kind="zbv"',
      "optim.zero=3", "train.micro_batch_size=4"], []),
    ("hybrid-cp4x2-tp2-sp", 8,
     ["topology.cp=4", "topology.cp_kind=hybrid", "topology.cp_ulysses=2", "topology.tp=2", SP,
      "train.micro_batch_size=16"], []),
    ("ulysses-cp2-hsdp-dp2-ep2-tp2-zero2", 8,
     [*MOE, "topology.dp=2", "topology.ep=2", "topology.cp=2", "topology.cp_kind=ulysses",
      "topology.tp=2", SP, 'topology.shard_within="2"', "optim.zero=2",
      "train.micro_batch_size=4"], [*MOE, "train.micro_batch_size=8"]),
    ("dualpipev-pp2xdp2xep2-moe-overlap", 4,
     [*MOE, "topology.pp=2", "topology.dp=2", "topology.ep=2", 'schedule.kind="dualpipev"',
      "schedule.moe_overlap=true"], [*MOE, "train.micro_batch_size=2"]),
]


@pytest.mark.parametrize("name,n,overrides,ref", [
    pytest.param(*LAYOUTS[0], marks=pytest.mark.smoke), *LAYOUTS[1:]],
    ids=[c[0] for c in LAYOUTS])
def test_cli_layout_equals_one_rank(tmp_path, session_dir, name, n, overrides, ref):
    reference = baseline(session_dir, *ref)
    run = train_cli(tmp_path / name, n, *overrides)
    assert_same(run, reference, rel=1e-9, what=name)
    assert run.losses[-1] < run.losses[0]  # and it learns
