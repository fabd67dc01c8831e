"""A node lost mid-run on the simulated cluster (scripts/cluster.sh: 3 nodes x 2 ranks):
``hpctrain launch --relaunch`` probes the nodes, drops the dead one, re-plans the layout for
the 4 ranks left and resumes from the freshest checkpoint, the lost node's shards from their
partner copies on a surviving node; the run equals one rank (float64, 1e-9: losses, grad
norms, final parameters), every step once, so the data position resumed exactly. Skipped
where namespaces cannot be made (not root)."""

import json
import shutil
import subprocess
import time

import pytest
from launch import PY, ROOT, TINY, assert_same, baseline, env, read_run, simulated_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

SCRIPT = str(ROOT / "scripts/cluster.sh")
STEPS = 6


@pytest.fixture(scope="module")
def cluster():
    yield from simulated_cluster("rl", 3)


@pytest.mark.slow(reason="3 simulated nodes, a node lost, probing and relaunching on 2")
def test_a_lost_node_relaunches_on_the_survivors_with_a_new_layout(cluster, tmp_path,
                                                                   session_dir):
    run_dir = tmp_path / "run"
    nodes = [f"hpct-{cluster}-n{i}" for i in range(3)]
    cmd = [PY, "-m", "hpctrain", "launch", "--relaunch", "1", "--probe-timeout", "60",
           "--grace", "10",
           "--hosts", ",".join(f"{n}:2" for n in nodes), "--program",
           f"{SCRIPT} mpirun {cluster}", "--", PY, "-m", "mpi4py", "-m", "hpctrain", "train",
           TINY, "--run-dir", str(run_dir), "--set", "topology.dp=2", "--set", "topology.pp=3",
           "--set", f"train.steps={STEPS}", "--set", "checkpoint.every=0",
           "--set", "checkpoint.local_every=1",
           "--set", f"checkpoint.local_dir={tmp_path}/local/{{node}}"]
    out_file, err_file = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out_file, stderr=err_file)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()
            assert time.monotonic() < deadline, "no 3 steps in 240 s"
            time.sleep(0.1)
        subprocess.run([SCRIPT, "lose", cluster, "2"], check=True)  # kill -9, node gone
        shutil.rmtree(tmp_path / "local" / nodes[2])  # its node-local storage went with it
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        out_file.close()
        err_file.close()
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, err[-6000:]
    failure, done = [json.loads(x) for x in (run_dir / "relaunch.jsonl").read_text().splitlines()]
    assert failure["dropped"] == [nodes[2]] and failure["hosts"] == nodes[:2]
    assert nodes[2] in failure["named"]  # mpirun's message names the lost node
    layout = dict(w.split("=", 1) for w in failure["layout"][1::2])
    world = 1
    for axis in ("dp", "tp", "pp", "cp"):
        world *= int(layout[f"topology.{axis}"])
    assert world == 4, layout  # re-planned for the 4 ranks left
    assert done["rc"] == 0 and done["recover_s"] > 0
    assert done["resumed_step"] >= 1  # no HDF5 file before the end: only the local tier
    assert done["steps_lost"] == failure["last_step"] - done["resumed_step"]
    assert "[relaunch] relaunch 1/1 on " + ",".join(nodes[:2]) in err
    assert "[relaunch] relaunch 1: first step done" in err
    out = (tmp_path / "out.txt").read_text()
    assert f"restart: tier partner, step {done['resumed_step']}" in out, out[-4000:]
    run = read_run(run_dir)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1)), "a step lost/redone"
    assert_same(run, baseline(session_dir, f"train.steps={STEPS}"), 1e-9,
                "relaunched on 2 of 3 nodes vs one rank")
