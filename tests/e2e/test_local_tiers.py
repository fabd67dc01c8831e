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
    assert not list(run_dir.glob("checkpoints/step_*.h5"))  # same layout: read in place
    # written anew and pruned: local_keep = 1 complete generation + the last one written
    assert sorted(p.name for p in gen2.parent.iterdir()) == ["step_00000004", "step_00000005"]
    assert len(list(gen2.parent.glob("step_00000005/rank_*.json"))) == 2
    same_losses(read_run(run_dir, proc.stdout), baseline(session_dir, *common[:2]))
