"""Asynchronous checkpoints (``checkpoint.async = true``) through the real CLI: the files
equal a synchronous run's dataset by dataset, the run still equals one rank, a rank killed
or a write failing in the background leaves ``latest`` on the previous checkpoint, and a
preemption during a background write ends with the checkpoint of the step it announced."""

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from launch import (
    assert_same,
    baseline,
    hpctrain,
    mpirun,
    read_run,
    rel_err,
    signal_after_steps,
    train_args,
    train_cli,
)

pytestmark = pytest.mark.e2e

COMMON = ("train.steps=6", "checkpoint.every=3")  # the resharding tests' baseline
ASYNC = "checkpoint.async=true"
# File attributes that name when and how a file was written, not what it holds.
WHEN = {"created", "config", "lineage", "git_commit"}


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}.h5"


def _contents(path: Path) -> tuple[dict, dict]:
    """({dataset: (array, crc32 attribute)}, file attributes less WHEN)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, (o[...], int(o.attrs["crc32"])))
                     if hasattr(o, "shape") else None)
        attrs = {k: v for k, v in f.attrs.items() if k not in WHEN}
    return out, attrs


def test_async_files_equal_sync_ones_and_the_run_equals_one_rank(tmp_path, session_dir):
    """ZeRO-1 dp=2: every rank writes its own optimizer shards from the background."""
    zero = "optim.zero=1"
    sync = train_cli(tmp_path / "sync", 2, "topology.dp=2", zero, *COMMON)
    run = train_cli(tmp_path / "async", 2, "topology.dp=2", zero, *COMMON, ASYNC)
    for step in (3, 6):
        (a, a_attrs), (s, s_attrs) = _contents(ckpt(run.run_dir, step)), \
            _contents(ckpt(sync.run_dir, step))
        assert set(a) == set(s) and any(k.startswith("optim/") for k in a)
        for name in s:
            assert np.array_equal(a[name][0], s[name][0]), f"step {step}: {name} differs"
            assert a[name][1] == s[name][1], f"step {step}: {name} crc32 differs"
        assert a_attrs.keys() == s_attrs.keys()
        a_layout, s_layout = (json.loads(x.pop("layout")) for x in (a_attrs, s_attrs))
        assert (a_layout.pop("async"), s_layout.pop("async")) == (True, False)
        assert a_layout == s_layout
        for k in s_attrs:
            assert np.array_equal(a_attrs[k], s_attrs[k]), k
    assert hpctrain(["inspect", str(run.run_dir / "checkpoints"), "--verify"]).returncode == 0
    assert_same(run, baseline(session_dir, *COMMON), rel=1e-9, what="async ZeRO-1 dp=2")
    # metrics: the step's blocked time, and the background write reported when it ends
    saves = [m for m in run.metrics if "ckpt_blocked_s" in m]
    assert [m["step"] for m in saves] == [3, 6]
    done = {m.get("ckpt_async_step"): m for m in run.metrics if "ckpt_async_step" in m}
    assert set(done) == {3, 6}, done.keys()
    for m in done.values():
        assert m["ckpt_background_s"] > 0 and m["ckpt_save_bytes"] > 0
    assert all(m["ckpt_blocked_s"] > 0 for m in saves)


def test_rank_killed_during_a_background_write_then_resume(tmp_path, session_dir):
    run_dir = tmp_path / "run"
    args = train_args(run_dir, "topology.dp=2", "train.steps=6", "checkpoint.every=1", ASYNC)
    proc = mpirun(2, args, check=False, timeout=180, extra_env={
        "HPCTRAIN_FAULTS": "ckpt_kill@1:4"})
    assert proc.returncode != 0
    assert "rank 1 killed while saving step 4" in proc.stderr
    d = run_dir / "checkpoints"
    assert (d / "latest").read_text().strip() == "step_00000003.h5"
    assert not (d / "step_00000004.h5").exists()
    assert hpctrain(["inspect", str(d), "--verify"]).returncode == 0
    resumed = train_cli(run_dir, 1, "train.steps=6", "checkpoint.resume=auto")  # 1 rank
    assert "at step 3" in resumed.stdout
    ref = baseline(session_dir, *COMMON)
    tail = [m["loss"] for m in resumed.metrics if m["step"] > 3][-3:]
    assert len(tail) == 3 and rel_err(tail, ref.losses[3:]) <= 1e-9, (tail, ref.losses)
    for name, value in ref.params.items():
        assert rel_err(resumed.params[name], value) <= 1e-9, name


def test_failed_background_write_is_reported_on_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(run_dir, "topology.dp=2", "train.steps=6", "checkpoint.every=1", ASYNC)
    proc = mpirun(2, args, check=False, timeout=180, extra_env={
        "HPCTRAIN_FAULTS": "ckpt_fail@1:3"})
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: the background save of step 3 failed on rank 1 "
                         r"\(OSError: fault injection: rank 1 cannot write step 3\)",
                         proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    d = run_dir / "checkpoints"
    assert (d / "latest").read_text().strip() == "step_00000002.h5"
    assert not (d / "step_00000003.h5").exists()
    steps = [m["step"] for m in read_run(run_dir).metrics]
    assert steps == [1, 2, 3], steps  # reported in step 4, before its record


def test_preemption_during_a_background_write_commits_the_announced_step(tmp_path):
    """Every step saves and each background write takes >= 1 s (a slow file system), so
    a write is in flight when SIGUSR1 arrives; the run stops at step k with step k whole."""
    run_dir = tmp_path / "run"
    returncode, out = signal_after_steps(
        run_dir, 2, "topology.dp=2", "train.steps=40", "checkpoint.every=1", ASYNC,
        extra_env={"HPCTRAIN_FAULTS": "ckpt_slow@*:*:1"})
    assert returncode == 0, out
    stop = re.search(r"stopping at step (\d+): signal SIGUSR1", out)
    assert stop, out
    k = int(stop.group(1))
    d = run_dir / "checkpoints"
    assert (d / "latest").read_text().strip() == f"step_{k:08d}.h5"
    assert hpctrain(["inspect", str(d / f"step_{k:08d}.h5"), "--verify"]).returncode == 0
    assert not list(d.glob(".step_*.tmp"))
    last = read_run(run_dir).metrics[-1]
    assert last["step"] == k and last["ckpt_async_step"] == k
    assert last["ckpt_wait_s"] >= 0.5  # the save before k was still being written


def test_a_hanging_background_write_is_reported_by_the_watchdog(tmp_path):
    """The steps go on while the write of step 2 hangs (120 s before its commit), so they
    keep the watchdog fed; it watches the write's age instead and fires after the checkpoint
    limit (10 x the pinned 1 s), naming the write. One rank: the cheapest run."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, "train.steps=4", "checkpoint.every=2", ASYNC,
                      "telemetry.watchdog_s=1", "telemetry.watchdog_factor=0")
    proc = mpirun(1, args, check=False, timeout=90,  # a hang raises TimeoutExpired
                  extra_env={"HPCTRAIN_FAULTS": "ckpt_slow@*:*:120"})
    assert proc.returncode != 0
    msg = (run_dir / "watchdog" / "summary.txt").read_text()
    assert "the background write of checkpoint step 2 has run for 1" in msg, msg
    assert msg.splitlines()[0] in proc.stderr
    assert not (run_dir / "checkpoints" / "step_00000002.h5").exists()
