"""The relaunch loop of ``hpctrain launch --relaunch`` (hpctrain/job/relaunch.py) without MPI:
host lists, what launchers say about a dead node, the launcher lines, the loop's decisions
with the step, the probe and the re-plan replaced; and ``hpctrain plan --emit-overrides``.
The real thing (a node lost on the simulated cluster, a killed SLURM step) is
tests/e2e/test_relaunch_cluster.py and tests/e2e/test_slurm.py."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.config import load
from hpctrain.job import relaunch
from hpctrain.job.launch import Launcher
from hpctrain.job.relaunch import Attempt, Host, Plan

TINY = "share/configs/tiny-llama.toml"
CMD = ["py", "-m", "mpi4py", "-m", "hpctrain", "train", TINY, "--run-dir", "", "--set",
       "topology.dp=6"]
HOSTS = [Host("n0", 2), Host("n1", 2), Host("n2", 2)]


def test_hosts_and_slurm_task_counts():
    assert relaunch.parse_hosts("a:2, b:3,c") == [Host("a", 2), Host("b", 3), Host("c", 1)]
    for bad in ("a:0", "a:x", ",a:2"):
        with pytest.raises(ValueError, match="NAME:SLOTS"):
            relaunch.parse_hosts(bad)
    with pytest.raises(ValueError, match="not understood"):
        relaunch.tasks_per_node("2(3)")


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_tasks_per_node_expands_slurms_runs(counts):
    runs, i = [], 0
    while i < len(counts):  # SLURM's compression: equal neighbours as N(xK)
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        runs.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    assert relaunch.tasks_per_node(",".join(runs)) == counts


def test_the_node_a_launcher_names():
    ompi = ("ORTE has lost communication with a remote daemon.\n"
            "  HNP daemon   : [[1,0],0] on node vm\n"
            "  Remote daemon: [[1,0],3] on node n2\n")
    assert relaunch.named_hosts(ompi, HOSTS) == ["n2"]  # vm is not one of the hosts
    noticed = "mpirun noticed that process rank 4 with PID 0 on node n1 exited on signal 9"
    assert relaunch.named_hosts(noticed, HOSTS) == ["n1"]
    srun = "srun: error: n0: task 1: Killed\nsrun: error: n0: tasks 2-3: Killed\n"
    assert relaunch.named_hosts(srun, HOSTS) == ["n0"]
    assert relaunch.named_hosts("Segmentation fault", HOSTS) == []


def test_launcher_lines_pin_the_hosts():
    two = HOSTS[:2]
    ompi = relaunch.step_argv(Launcher("openmpi", ("mpirun",)), two, ["x"])
    assert ompi[:3] == ["mpirun", "-n", "4"] and ompi[-3:] == ["--host", "n0:2,n1:2", "x"]
    hydra = relaunch.step_argv(Launcher("hydra", ("mpiexec",)), two, ["x"])
    assert hydra[-3:] == ["-hosts", "n0:2,n1:2", "x"]
    srun = relaunch.step_argv(Launcher("srun", ("srun", "--mpi=pmix")), two, ["x"])
    assert srun[:4] == ["srun", "--mpi=pmix", "-n", "4"] and "--overcommit" not in srun
    assert srun[-4:] == ["--nodes=2", "--nodelist=n0,n1", "--ntasks-per-node=2", "x"]


def test_train_parts_and_refusal():
    cmd = [*CMD[:8], "/r", "--set", "a.b=1", "--set", "c.d=2"]
    assert relaunch.train_parts(cmd) == ("py", TINY, ["a.b=1", "c.d=2"], "/r")
    with pytest.raises(ValueError, match="-m hpctrain train CONFIG"):
        relaunch.train_parts(["py", "-m", "hpctrain", "plan", TINY])
    words = ["--set", "topology.dp=2", "--set", "topology.tp=1", "--set", 'schedule.kind="1f1b"',
             "--set", "optim.zero=1"]
    assert relaunch.layout_of(words) == "dp=2 tp=1 kind=1f1b"


def fake(monkeypatch, attempts, alive, layouts=(("--set", "topology.dp=4"),)):
    """Replace the step, the probe and the re-plan; returns the calls made."""
    calls = {"argv": [], "probed": [], "replanned": []}
    attempts, layouts = list(attempts), list(layouts)

    def run_step(argv, on_step=None, grace=30.0):
        calls["argv"].append(argv)
        return attempts.pop(0)

    def probe(launcher, hosts, timeout):
        calls["probed"].append([h.name for h in hosts])
        return [h for h in hosts if h.name in alive]

    def replan(command, hosts, cluster=""):
        calls["replanned"].append([h.name for h in hosts])
        return list(layouts.pop(0))

    monkeypatch.setattr(relaunch, "run_step", run_step)
    monkeypatch.setattr(relaunch, "probe", probe)
    monkeypatch.setattr(relaunch, "replan", replan)
    return calls


def plan(hosts=HOSTS, spare=0, relaunches=2):
    return Plan(Launcher("openmpi", ("mpirun",)), hosts, hosts[:len(hosts) - spare], CMD,
                relaunches)


def test_a_lost_node_is_dropped_and_the_layout_replanned(monkeypatch):
    calls = fake(monkeypatch, [Attempt(rc=137, last_step=5), Attempt(rc=0, resumed=4)],
                 alive={"n0", "n1"})
    p = plan()
    assert relaunch.loop(p) == 0
    assert calls["probed"] == [["n0", "n1", "n2"]] and calls["replanned"] == [["n0", "n1"]]
    first, again = calls["argv"]
    assert "n0:2,n1:2,n2:2" in first and "checkpoint.resume=auto" not in first
    assert "n0:2,n1:2" in again
    assert again[-2:] == ["--set", "checkpoint.resume=auto"] and "topology.dp=4" in again
    assert p.dropped == ["n2"]


def test_a_spare_replaces_the_lost_node_with_the_configured_layout(monkeypatch):
    calls = fake(monkeypatch, [Attempt(rc=1), Attempt(rc=0)], alive={"n0", "n2"})
    p = plan(spare=1)
    assert relaunch.loop(p) == 0
    assert calls["replanned"] == [] and p.layout == []
    assert "n0:2,n2:2" in calls["argv"][1]


def test_when_to_stop_relaunching(monkeypatch):
    fake(monkeypatch, [Attempt(rc=1)] * 3, alive={"n0", "n1", "n2"})
    assert relaunch.loop(plan(relaunches=2)) == relaunch.EXIT_REQUEUE  # spent: requeue
    for rc in (0, 2, 75):  # done, bad input, checkpointed for a requeue: as the step said
        calls = fake(monkeypatch, [Attempt(rc=rc)], alive=set())
        assert relaunch.loop(plan()) == rc and calls["probed"] == []
    fake(monkeypatch, [Attempt(rc=1)], alive=set())
    assert relaunch.loop(plan()) == relaunch.EXIT_REQUEUE  # no host answers


def test_no_layout_for_the_ranks_left_requeues(monkeypatch):
    fake(monkeypatch, [Attempt(rc=1)], alive={"n0"})
    monkeypatch.setattr(relaunch, "replan", lambda *a, **k: (_ for _ in ()).throw(
        ValueError("no layout of 2 rank(s) fits")))
    assert relaunch.loop(plan()) == relaunch.EXIT_REQUEUE


@given(alive=st.sets(st.sampled_from(["n0", "n1", "n2", "n3"])), spare=st.integers(0, 3))
def test_survivors_are_alive_hosts_never_more_than_before(alive, spare):
    hosts = [Host(f"n{i}", 2) for i in range(4)]
    p = plan(hosts, spare)
    p.world = sum(h.slots for h in p.used)
    before = len(p.used)
    relaunch.probe, saved = (lambda launcher, hs, t: [h for h in hs if h.name in alive]), \
        relaunch.probe
    relaunch.replan, saved_replan = (lambda *a, **k: ["--set", "topology.dp=1"]), relaunch.replan
    try:
        why = p.survivors(Attempt(rc=1))
    finally:
        relaunch.probe, relaunch.replan = saved, saved_replan
    assert (why is not None) == (not alive)
    assert {h.name for h in p.used} <= alive and len(p.used) == min(before, len(alive))
    assert set(p.dropped) == {h.name for h in hosts} - alive
    if alive:  # re-planned only with fewer ranks
        assert (p.layout == []) == (len(p.used) == before)


def emit(capsys, *args) -> tuple[int, str, str]:
    from hpctrain.__main__ import main

    rc = main(["plan", TINY, "--emit-overrides", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_emit_overrides_is_a_valid_layout_of_the_ranks_left(capsys):
    from hpctrain.checks.validate import validate

    rc, out, _ = emit(capsys, "--world-size", "4", "--nodes", "2", "--set", "topology.cp=2",
                      "--set", "topology.tp=2")
    assert rc == 0
    words = [w for line in out.splitlines() for w in shlex.split(line)]
    assert words[::2] == ["--set"] * (len(words) // 2)
    cfg = load(TINY, ["topology.cp=2", "topology.tp=2", *words[1::2]])  # they replace a layout
    t = cfg.topology
    assert t.dp * t.tp * t.pp * t.cp == 4
    validate(cfg, 4)
    assert cfg.train.global_batch_size == load(TINY, []).train.global_batch_size


def test_emit_overrides_refuses_when_nothing_fits(capsys):
    rc, out, err = emit(capsys, "--world-size", "4", "--memory-per-rank", "1KiB")
    assert rc == 2 and out == ""
    assert "no layout of 4 rank(s) fits" in err and "does not fit in memory" in err
    rc, _, err = emit(capsys, "--world-size", "4", "--nodes", "3")
    assert rc == 2 and "is not --nodes 3" in err


RAISES = ["[hpctrain] step 5/9 | loss 3.0\n",
          "hpctrain: rank 1 of 6: unhandled OSError; ending every rank (MPI_Abort)\n"]


def test_the_same_failure_again_stops_instead_of_relaunching(monkeypatch, tmp_path):
    """An exception at the same step twice is not a lost node: exit 3, no requeue; a rank
    that dies (the launcher says so) or another exception is relaunched as before."""
    same = Attempt(rc=1, last_step=5, tail=RAISES)
    calls = fake(monkeypatch, [same, same, Attempt(rc=0)], alive={"n0", "n1", "n2"})
    assert relaunch.loop(plan(relaunches=3)) == relaunch.EXIT_REPEATED
    assert len(calls["argv"]) == 2  # the first relaunch only
    died = Attempt(rc=1, last_step=5, tail=RAISES, died_at=1.0)
    other = Attempt(rc=1, last_step=6, tail=RAISES)
    fake(monkeypatch, [same, died, died, other, Attempt(rc=0)], alive={"n0", "n1", "n2"})
    assert relaunch.loop(plan(relaunches=4)) == 0


def test_a_failure_repeated_after_a_requeue_stops(monkeypatch, tmp_path):
    """The job before this one (relaunch.jsonl of the run) failed the same way: the first
    failure here stops the chain of requeues."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "relaunch.jsonl").write_text(json.dumps({"failure": 1, "signature": [5, "OSError"]})
                                        + "\n")
    cmd = [*CMD[:8], str(run), *CMD[9:]]
    fake(monkeypatch, [Attempt(rc=1, last_step=5, tail=RAISES)], alive=set())
    p = Plan(Launcher("openmpi", ("mpirun",)), HOSTS, HOSTS, cmd, 2)
    assert relaunch.loop(p) == relaunch.EXIT_REPEATED
    assert "repeated" in (run / "relaunch.jsonl").read_text().splitlines()[-1]
