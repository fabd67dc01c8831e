"""The CLI as a user runs it: errors before any collective, prepare, a run directory."""

import json

import pytest
from launch import TINY, hpctrain, mpirun, train_cli

pytestmark = pytest.mark.e2e


def test_impossible_layout_fails_fast_with_arithmetic(tmp_path):
    proc = mpirun(2, ["-m", "hpctrain", "train", TINY, "--run-dir", str(tmp_path),
                      "--set", "topology.dp=4"], check=False, timeout=60)
    assert proc.returncode != 0
    assert "dp*tp*pp = 4*1*1 = 4 but the world has 2 ranks" in proc.stderr
    assert proc.stderr.count("world has 2 ranks") == 1  # said once, by rank 0
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_key_and_bad_type():
    p = hpctrain(["train", TINY, "--run-dir", "/tmp/x", "--set", "train.stepz=3"], check=False)
    assert p.returncode == 2 and "unknown key train.stepz" in p.stderr
    p = hpctrain(["train", TINY, "--run-dir", "/tmp/x", "--set", "train.steps=abc"], check=False)
    assert p.returncode == 2 and "train.steps must be an integer" in p.stderr


def test_prepare_then_train_on_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text(f"line {i} of some text to learn from\n" * 40)
    data = tmp_path / "data.h5"
    out = hpctrain(["prepare", str(src), "--out", str(data), "--val-fraction", "0.1"])
    assert "40 documents" in out.stdout
    run = train_cli(tmp_path / "run", 2, "topology.dp=2", f"data.path=\"{data}\"",
                    "train.steps=3")
    assert len(run.losses) == 3
    rec = run.metrics[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert key in rec
    assert (tmp_path / "run" / "config.toml").read_text().count("[topology]") == 1
    assert "step 3/3" in run.stdout and "tok/s" in run.stdout and "ETA" in run.stdout
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
