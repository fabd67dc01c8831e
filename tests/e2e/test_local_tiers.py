"""The local tier through the real CLI under mpirun: a run whose node dies mid-run continues
on the surviving nodes with another layout from the partner copies, and its losses equal one
rank's straight run (float64, 1e-9: parameters, optimizer state and data position all came
back); a local copy killed while written is never used (the generation before it is)."""

import json
import os
import shutil
import subprocess

import h5py
import pytest
from launch import ROOT, baseline, mpirun, read_run, rel_err, train_args

from hpctrain.job.launch import cluster_program

pytestmark = [pytest.mark.e2e]

SCRIPT = str(ROOT / "scripts/cluster.sh")


def tiers(tmp, every: int, steps: int) -> list[str]:
    return [f"train.steps={steps}", f"checkpoint.local_every={every}",
            f"checkpoint.local_dir={tmp}/local/{{node}}", "checkpoint.save_final=false"]


def recovery(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["recovery"]


def same_losses(run, ref) -> None:
    """Every step of ``run``'s trajectory (metrics.jsonl: the killed run's steps up to the
    restored one, then the restarted run's) equals the straight one-rank run ``ref``."""
    steps = [m["step"] for m in run.metrics]
    assert steps == [m["step"] for m in ref.metrics], steps
    for m, r in zip(run.metrics, ref.metrics):
        assert rel_err(m["loss"], r["loss"]) <= 1e-9, (m["step"], m["loss"], r["loss"])


@pytest.fixture(scope="module")
def cluster():
    """Three simulated nodes of 2 ranks (cluster NAME `tiers`), removed after."""
    check = subprocess.run([SCRIPT, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        if os.geteuid() == 0 and shutil.which("ip"):
            pytest.fail(f"scripts/cluster.sh check failed as root: {check.stderr.strip()}")
        pytest.skip(f"no simulated cluster here (needs root): {check.stderr.strip()}")
    subprocess.run([SCRIPT, "down", "tiers"], capture_output=True)  # left by a killed run
    subprocess.run([SCRIPT, "up", "tiers", "3", "2"], check=True, capture_output=True)
    try:
        yield cluster_program(SCRIPT, "tiers")
    finally:
        subprocess.run([SCRIPT, "down", "tiers"], check=True)


@pytest.mark.netns
@pytest.mark.slow(reason="3 simulated nodes: a run, a node killed, a restart on 2")
def test_node_lost_resumes_on_survivors_from_partner_copies(cluster, tmp_path, session_dir):
    """3 nodes x 2 ranks (dp=3 x tp=2), both ranks of node 1 killed in step 5 and its local
    directory gone; the same command on nodes 0 and 2 with pp=2 x dp=2 resumes from the
    local generation of step 4 (node 1's shards from their partner copies on node 2)."""
    common = ["train.global_batch_size=12", *tiers(tmp_path, 2, 5)]
    run_dir = tmp_path / "run"
    killed = mpirun(6, train_args(run_dir, "topology.dp=3", "topology.tp=2", *common),
                    launcher=cluster, check=False,
                    extra_env={"HPCTRAIN_FAULTS": "kill@2:5;kill@3:5"})
    assert killed.returncode != 0, killed.stdout[-2000:]
    lost = tmp_path / "local" / "hpct-tiers-n1"
    assert lost.is_dir() and (tmp_path / "local" / "hpct-tiers-n2").is_dir()
    shutil.rmtree(lost)  # the node and its storage are gone
    proc = mpirun(4, train_args(run_dir, "topology.dp=2", "topology.pp=2", *common),
                  launcher=cluster, mpirun_args=("--host", "hpct-tiers-n0:2,hpct-tiers-n2:2"))
    second = read_run(run_dir, proc.stdout)
    got = recovery(run_dir)
    assert got["tier"] == "partner" and got["reshard"] and got["step"] in (2, 4), got
    assert f"restart: tier partner, step {got['step']}" in proc.stdout
    with h5py.File(got["path"], "r") as f:  # assembled from the shards, global shapes
        assert f.attrs["world_size"] == 6 and f.attrs["step"] == got["step"]
        assert f.attrs["data_samples_seen"] == 12 * got["step"]  # the data position
    same_losses(second, baseline(session_dir, *common[:2]))


def test_half_written_local_copy_is_never_used(tmp_path, session_dir):
    """Rank 1 killed halfway through writing its shard of generation 2 (after step 2): the
    restart on the same layout reads every rank's own shard of generation 1 (no HDF5 file
    anywhere), and the run equals one rank's straight run."""
    common = ["train.global_batch_size=12", *tiers(tmp_path, 1, 5)]
    run_dir = tmp_path / "run"
    killed = mpirun(2, train_args(run_dir, "topology.dp=2", *common), check=False,
                    extra_env={"HPCTRAIN_FAULTS": "local_kill@1:2"})
    assert killed.returncode != 0 and "killed while writing local shard" in killed.stderr
    (gen2,) = (tmp_path / "local").glob("*/run_*/step_00000002")
    assert (gen2 / "rank_00001.bin").exists() and not (gen2 / "rank_00001.json").exists()
    proc = mpirun(2, train_args(run_dir, "topology.dp=2", *common))
    got = recovery(run_dir)
    assert got["tier"] == "local" and got["step"] == 1 and not got["reshard"], got
    assert "restart: tier local, step 1" in proc.stdout
    torn = "torn shard(s) not used: step 2 rank 1: no committed marker"
    assert (proc.stdout + proc.stderr).count(torn) == 1, proc.stderr[-2000:]  # said once
    assert not list(run_dir.glob("checkpoints/step_*.h5"))  # same layout: read in place
    # written anew and pruned: local_keep = 1 complete generation + the last one written
    assert sorted(p.name for p in gen2.parent.iterdir()) == ["step_00000004", "step_00000005"]
    assert len(list(gen2.parent.glob("step_00000005/rank_*.json"))) == 2
    same_losses(read_run(run_dir, proc.stdout), baseline(session_dir, *common[:2]))


def _flip_in_data(path, dataset: str) -> None:
    """Flip a byte inside a dataset's storage (HDF5 pads between datasets)."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[offset + 5] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_a_reused_run_directory_never_resumes_the_deleted_run(tmp_path):
    """A run directory deleted and its path used again: the new run starts at step 0 (its
    checkpoint directory has a new run id), and the old run's local generations, which its
    markers name, are removed with a log line."""
    common = ["train.global_batch_size=12", *tiers(tmp_path, 1, 3)]
    run_dir = tmp_path / "run"
    first = mpirun(2, train_args(run_dir, "topology.dp=2", *common))
    assert list((tmp_path / "local").glob("*/run_*/step_00000003"))
    shutil.rmtree(run_dir)
    again = mpirun(2, train_args(run_dir, "topology.dp=2", *common))
    assert recovery(run_dir)["tier"] == "none" and "restart:" not in again.stdout
    assert "of another run from" in again.stdout, again.stdout[-3000:]
    assert [m["loss"] for m in read_run(run_dir, again.stdout).metrics] == \
        [m["loss"] for m in read_run(run_dir, first.stdout).metrics]  # a fresh start


def test_same_grid_other_pieces_restores_through_the_global_shapes(tmp_path, session_dir):
    """pp=2 killed in step 3; the restart keeps the grid but moves the stage boundary: each
    rank's own shard holds other layers, so the ranks agree to assemble the generation in
    global shapes instead of reading their own files (which crashed), and the run equals
    one rank's straight run."""
    common = ["train.global_batch_size=12", *tiers(tmp_path, 1, 4)]
    run_dir = tmp_path / "run"
    killed = mpirun(2, train_args(run_dir, "topology.pp=2", *common), check=False,
                    extra_env={"HPCTRAIN_FAULTS": "kill@0:3"})
    assert killed.returncode != 0
    proc = mpirun(2, train_args(run_dir, "topology.pp=2", 'schedule.boundaries="3"',
                                *common))
    got = recovery(run_dir)
    assert got["tier"] == "local" and got["step"] == 2 and got["reshard"], got
    same_losses(read_run(run_dir, proc.stdout), baseline(session_dir, *common[:2]))


def test_a_damaged_newest_file_keeps_the_fresher_local_generation(tmp_path, session_dir):
    """HDF5 files and local generations at steps 2 and 4; step 4's file damaged; a restart on
    another layout cannot read its own shards: it restores the sound local generation of
    step 4 (assembled), not the older file of step 2, and equals one rank's straight run."""
    common = ["train.global_batch_size=12", "optim.decay_steps=6", "checkpoint.every=2",
              *tiers(tmp_path, 2, 4)]
    run_dir = tmp_path / "run"
    mpirun(2, train_args(run_dir, "topology.dp=2", *common))
    _flip_in_data(run_dir / "checkpoints/step_00000004.h5", "model/blocks.0.attn.wq")
    common[3] = "train.steps=6"
    proc = mpirun(2, train_args(run_dir, "topology.pp=2", *common))
    got = recovery(run_dir)
    assert got["tier"] == "local" and got["step"] == 4 and got["reshard"], got
    same_losses(read_run(run_dir, proc.stdout), baseline(session_dir, *common[:2],
                                                         "train.steps=6"))


def test_a_failing_local_write_disables_the_tier_and_training_goes_on(tmp_path):
    """Rank 1's node-local write of generation 2 fails (a full disk): one warning, the tier
    is off for the run, the HDF5 checkpoints go on, the run ends normally."""
    common = ["train.global_batch_size=12", "checkpoint.every=2", *tiers(tmp_path, 1, 4)]
    run_dir = tmp_path / "run"
    proc = mpirun(2, train_args(run_dir, "topology.dp=2", *common),
                  extra_env={"HPCTRAIN_FAULTS": "local_fail@1:2"})
    out = proc.stdout + proc.stderr
    assert out.count("local checkpoint tier disabled") == 1, out[-3000:]  # said once
    assert "cannot write its local shard of step 2" in out
    assert len(read_run(run_dir, proc.stdout).metrics) == 4
    assert (run_dir / "checkpoints/step_00000004.h5").is_file()
    assert not list((tmp_path / "local").glob("*/run_*/step_00000003"))  # no more writes
