"""Every injected fault ends the job with a clear message or is recovered from.

Faults come from ``experimental.faults`` (see hpctrain/telemetry/fault_injection.py): a killed
rank, a stalled rank (watchdog), a poisoned gradient (numeric guard), an exception
(python -m mpi4py).
"""

import json
import math
import re
import subprocess
import time

import pytest
from launch import (
    LAUNCHER,
    PY,
    ROOT,
    assert_same,
    baseline,
    mpirun,
    read_params,
    read_run,
    rel_err,
    train_args,
    train_cli,
)
from launch import env as launch_env

from hpctrain.job.launch import command

pytestmark = pytest.mark.e2e

WATCHDOG_S = 8
# A fixed limit of WATCHDOG_S (watchdog_factor=0): the default would raise it to 10x the
# slowest step, and these tests count on the watchdog firing after WATCHDOG_S.
PINNED = "telemetry.watchdog_factor=0"
MARGIN_S = 60  # start-up of 2 ranks on a loaded machine, grace periods, abort


def launch(run_dir, n, *overrides, timeout, keep_going=False):
    return mpirun(n, train_args(run_dir, *overrides), timeout=timeout, check=False,
                  keep_going=keep_going)


def test_killed_rank_ends_the_job_and_the_last_checkpoint_resumes(tmp_path, session_dir):
    run_dir = tmp_path / "killed"
    proc = launch(run_dir, 2, "topology.dp=2", "checkpoint.every=2",
                     f"telemetry.watchdog_s={WATCHDOG_S}", PINNED, 'experimental.faults="kill@1:3"',
                     timeout=WATCHDOG_S + MARGIN_S)  # a hang raises TimeoutExpired
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002.h5"
    # Resumable: steps 3..5 continue exactly the uninterrupted run.
    resumed = train_cli(run_dir, 2, "topology.dp=2", "checkpoint.every=2",
                        'checkpoint.resume="auto"')
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4, 5]
    ref = baseline(session_dir)
    assert_same(resumed, ref, rel=1e-9, what="resumed after a killed rank")


def test_killed_rank_under_a_launcher_that_waits_is_ended_by_the_watchdog(tmp_path):
    # mpirun above ends the job itself when a process dies; with keep_going (Open MPI's
    # --enable-recovery, Hydra's -disable-auto-cleanup) it does not (like srun without
    # --kill-on-bad-exit): the survivor sits in the gradient all-reduce until its watchdog
    # names the dead rank and aborts. (In this mode mpirun reports exit status 0 whatever
    # the ranks return, so only the ending is checked.)
    run_dir = tmp_path / "killed_recovery"
    proc = launch(run_dir, 2, "topology.dp=2", f"telemetry.watchdog_s={WATCHDOG_S}", PINNED,
                  'experimental.faults="kill@1:2"', timeout=WATCHDOG_S + MARGIN_S,
                  keep_going=True)
    msg = (run_dir / "watchdog" / "summary.txt").read_text()
    assert "Stuck: rank 1: no flight record (dead" in msg, proc.stderr[-3000:]
    assert "rank 0 (pp=0, dp=0, ep=0, tp=0) on" in msg
    assert re.search(r"waiting in i?allreduce on dp", msg), msg
    assert msg.splitlines()[0] in proc.stderr


def test_stalled_rank_is_named_by_the_watchdog(tmp_path):
    run_dir = tmp_path / "stalled"
    proc = launch(run_dir, 2, "topology.dp=2", f"telemetry.watchdog_s={WATCHDOG_S}", PINNED,
                     'experimental.faults="stall@1:2:600"', timeout=WATCHDOG_S + MARGIN_S)
    assert proc.returncode != 0
    msg = (run_dir / "watchdog" / "summary.txt").read_text()
    assert msg.splitlines()[0] in proc.stderr  # the one message, printed once
    assert proc.stderr.count("hpctrain watchdog:") == 1
    head = msg.splitlines()[0]
    assert "Stuck: rank 1 (pp=0, dp=1, ep=0, tp=0)" in head and "'compute'" in head, msg
    assert "rank 0 (pp=0, dp=0, ep=0, tp=0)" in msg
    assert re.search(r"waiting in i?allreduce on dp", msg), msg
    for r in (0, 1):
        rec = json.loads((run_dir / "watchdog" / f"rank{r}.json").read_text())
        assert rec["rank"] == r and rec["step"] == 2 and rec["ops"]
        assert {"op", "axis", "peer", "peer_coords", "bytes", "state"} <= set(rec["ops"][-1])
    assert rec["phase"] == "compute"
    flying = [o for o in json.loads((run_dir / "watchdog" / "rank0.json").read_text())["ops"]
              if o["state"] == "in-flight"]
    assert flying and flying[-1]["axis"] == "dp"
    stack = (run_dir / "watchdog" / "rank1.stack").read_text()
    assert "fault_injection.py" in stack and "inject" in stack


def test_poisoned_gradients_skip_then_roll_back(tmp_path, session_dir):
    # Step 2 poisoned once: skipped, training goes on. Steps 4 and 5 poisoned: the second
    # consecutive skip (max_skips=2) rolls back to the last checkpoint (step 4).
    run = train_cli(tmp_path / "poison", 2, "topology.dp=2", "checkpoint.every=2",
                    "telemetry.max_skips=2",
                    'experimental.faults="poison@0:2;poison@0:4;poison@0:5"')
    by_step = {m["step"]: m for m in run.metrics}
    assert by_step[2]["skipped"] and "gradient norm is nan" in by_step[2]["skip_reason"]
    assert not math.isfinite(by_step[2]["grad_norm"])
    assert [by_step[s]["skipped"] for s in range(1, 6)] == [False, True, False, True, True]
    assert [by_step[s]["skips_total"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    assert [by_step[s]["rollbacks"] for s in range(1, 6)] == [0, 0, 0, 0, 1]
    assert "rolled back to" in by_step[5]["skip_reason"]
    assert by_step[5]["skip_reason"].endswith("step_00000004.h5")
    assert all(math.isfinite(m["loss"]) for m in run.metrics)
    # Steps 1 and 2 saw the same weights as the clean run; step 3 did not get step 2's update.
    ref = baseline(session_dir)
    assert rel_err(run.losses[:2], ref.losses[:2]) <= 1e-9
    assert rel_err(run.losses[2:3], ref.losses[2:3]) > 1e-9
    # After the roll-back the weights are the step-4 checkpoint's, saved again at step 5.
    ckpts = run.run_dir / "checkpoints"
    at4 = read_params(ckpts / "step_00000004.h5")
    assert at4 and all((run.params[k] == v).all() for k, v in at4.items())


def test_exception_on_one_rank_aborts_all(tmp_path):
    proc = launch(tmp_path / "raise", 2, "topology.dp=2", 'experimental.faults="raise@1:2"',
                     timeout=MARGIN_S)
    assert proc.returncode != 0
    assert "injected fault: rank 1 raises at step 2" in proc.stderr
    assert not (tmp_path / "raise" / "checkpoints" / "latest").exists()
    assert len(read_run(tmp_path / "raise").metrics) == 1


def test_exception_on_one_of_four_ranks_without_mpi4py_ends_the_job_promptly(tmp_path):
    """Started as ``mpirun -n 4 python -m hpctrain`` (no ``-m mpi4py``), with the watchdog off:
    rank 2 raises at step 2, the other ranks wait in that step's collective; hpctrain's own
    hook prints the traceback with the rank and aborts the world."""
    run_dir = tmp_path / "raise4"
    cmd = command(4, PY, *train_args(run_dir, "topology.dp=4", "telemetry.watchdog_s=0",
                                     'experimental.faults="raise@2:2"'), launcher=LAUNCHER)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)  # a hang: TimeoutExpired
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.time()
    after_fault = ended - (run_dir / "metrics.jsonl").stat().st_mtime  # step 1's record
    assert proc.returncode != 0, (out[-2000:], err[-4000:])
    assert "injected fault: rank 2 raises at step 2" in err, err[-4000:]
    assert "hpctrain: rank 2 of 4: unhandled RuntimeError" in err, err[-4000:]
    assert after_fault < 30, f"the job ended {after_fault:.1f} s after step 1"
    assert len(read_run(run_dir).metrics) == 1


@pytest.mark.parametrize("factor", [10, 0])
def test_slow_steps_raise_the_watchdog_limit(tmp_path, factor):
    # Every step is slowed by 0.6 s, then step 3 pauses 4.5 s without progress: longer than
    # the 3 s floor, shorter than 10 x the slowest step (>= 6 s). The adaptive limit lets the
    # run finish; pinned (factor 0) the same pause fires the watchdog.
    run_dir = tmp_path / f"factor{factor}"
    proc = launch(run_dir, 1, "train.steps=4", "telemetry.watchdog_s=3",
                  f"telemetry.watchdog_factor={factor}",
                  'experimental.faults="slow@0:1:0.6;stall@0:3:4.5"', timeout=MARGIN_S + 30)
    fired = (run_dir / "watchdog" / "summary.txt").is_file()
    if factor:
        assert proc.returncode == 0 and not fired, proc.stderr[-3000:]
        assert len(read_run(run_dir).metrics) == 4
        assert "watchdog max(3 s, 10 x slowest step)" in proc.stdout
    else:
        assert proc.returncode != 0 and fired, proc.stderr[-3000:]
        assert "no progress for 3 s" in proc.stderr
