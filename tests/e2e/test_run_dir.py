"""A run directory that already holds checkpoints, through the real CLI: the same command
again continues the run (``checkpoint.resume = "auto"`` is the default) and overwrites
nothing; an explicit fresh start into it is refused; resuming from an older checkpoint sets
the newer ones aside, and retention and the damaged-file fallback follow the trajectory
being trained, not the file names."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from launch import TINY, hpctrain, mpirun, read_run, train_args, train_cli

pytestmark = pytest.mark.e2e


def _tree(d: Path) -> dict:
    """Every file under ``d``: relative path -> (sha256, mtime_ns)."""
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                    p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("step_*.h5"))


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    pos = len(raw) * 3 // 4
    raw[pos:pos + 64] = bytes(b ^ 0x5A for b in raw[pos:pos + 64])
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> Path:
    """A 6-step run saving every 2 steps (step_2, step_4, step_6)."""
    run = train_cli(tmp_path_factory.mktemp("six") / "run", 1, "train.steps=6",
                    "checkpoint.every=2")
    assert _names(run.run_dir / "checkpoints") == [
        "step_00000002.h5", "step_00000004.h5", "step_00000006.h5"]
    return run.run_dir


def test_rerun_continues_and_a_fresh_start_is_refused(tmp_path, six):
    run_dir = tmp_path / "run"
    shutil.copytree(six, run_dir)
    d = run_dir / "checkpoints"
    before = _tree(run_dir)

    # An explicit fresh start into a directory with checkpoints: refused, nothing changed.
    proc = hpctrain(["train", TINY, "--run-dir", str(run_dir), "--set", "train.steps=8",
                     "--set", "checkpoint.every=2", "--set", 'checkpoint.resume=""'],
                    check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    line = [x for x in proc.stderr.splitlines() if x.startswith("hpctrain train:")]
    assert len(line) == 1, proc.stderr
    assert str(d) in line[0] and "checkpoint.resume=auto" in line[0], line[0]
    assert "--run-dir" in line[0] and "move" in line[0], line[0]
    assert _tree(run_dir) == before, "a refused start changed the run directory"

    # The same command again, with more steps: it continues from step 6 (the default).
    run = train_cli(run_dir, 2, "topology.dp=2", "train.steps=8", "checkpoint.every=2",
                    "checkpoint.keep=0")
    assert "at step 6" in run.stdout, run.stdout[-2000:]
    assert _steps(run_dir) == list(range(1, 9)), "metrics.jsonl holds more than one trajectory"
    after = _tree(run_dir)
    for name in _names(d):
        key = f"checkpoints/{name}"
        if key in before:
            assert after[key] == before[key], f"{name} was overwritten"
    assert _names(d) == [f"step_{s:08d}.h5" for s in (2, 4, 6, 8)]
    assert (d / "latest").read_text().strip() == "step_00000008.h5"

    # Once more, finished: it says so and trains nothing; no checkpoint or record changes.
    done = _tree(run_dir)
    again = hpctrain(["train", TINY, "--run-dir", str(run_dir), "--set", "train.steps=8",
                      "--set", "checkpoint.every=2", "--set", "checkpoint.keep=0"])
    assert "nothing to train: step 8 of train.steps=8 is done" in again.stdout, again.stdout
    assert _steps(run_dir) == list(range(1, 9))
    now = _tree(run_dir)
    assert {k: v for k, v in now.items() if k.startswith("checkpoints/step_")} == \
        {k: v for k, v in done.items() if k.startswith("checkpoints/step_")}


def test_resume_from_older_sets_aside_prunes_and_falls_back_along_the_trajectory(tmp_path,
                                                                                six):
    run_dir = tmp_path / "run"
    shutil.copytree(six, run_dir)
    d = run_dir / "checkpoints"
    old = _tree(d)
    # Back to step 2, 2 more steps, a save at each, keep 2: steps 3 and 4 stay, the old
    # trajectory's 4 and 6 are set aside (not deleted), step 2 is pruned by keep = 2.
    run = train_cli(run_dir, 1, "train.steps=4", "checkpoint.every=1", "checkpoint.keep=2",
                    f"checkpoint.resume={d / 'step_00000002.h5'}")
    assert _names(d) == ["step_00000003.h5", "step_00000004.h5"], sorted(d.iterdir())
    aside = [p for p in (d / "abandoned").iterdir()]
    assert len(aside) == 1 and _names(aside[0]) == ["step_00000004.h5", "step_00000006.h5"]
    for name in _names(aside[0]):  # moved, not rewritten
        assert hashlib.sha256((aside[0] / name).read_bytes()).hexdigest() == \
            old[name][0], name
    assert "set aside" in run.stdout and str(aside[0]) in run.stdout, run.stdout[-3000:]
    assert _steps(run_dir) == [1, 2, 3, 4], "metrics.jsonl holds more than one trajectory"
    assert len(read_run(run_dir).metrics) == 4

    # step_4 of this trajectory damaged: resume=auto falls back to step 3, not to 6.
    _flip(d / "step_00000004.h5")
    proc = mpirun(1, train_args(run_dir, "train.steps=5", "checkpoint.every=1",
                                "checkpoint.keep=2"))
    assert "step_00000004.h5 is damaged" in proc.stderr, proc.stderr[-3000:]
    assert "step_00000003.h5 at step 3" in proc.stdout, proc.stdout[-3000:]
    assert _names(d) == ["step_00000004.h5", "step_00000005.h5"]
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    damaged = [p for p in (d / "abandoned").glob("*/step_00000004.h5")
               if p.parent != aside[0]]
    assert len(damaged) == 1, list((d / "abandoned").rglob("*"))

