"""What a batch job resolves before it starts ranks (hpctrain.cli.batch, asked by jobs/env.sh,
jobs/dry-run.sh and ``hpctrain submit``): the config's layout against the task count, the
run's name, and the run directory's state."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import ROOT, TINY

from hpctrain.cli import batch
from hpctrain.job.slurm import run_name

LLAMA8B = str(ROOT / "share/configs/llama3-8b.toml")  # dp=8 x tp=4: 32 ranks


def test_a_config_layout_that_fits_the_tasks_is_kept():
    assert batch.layout(LLAMA8B, [], 32) == []


def test_an_explicit_layout_that_does_not_fit_is_refused_with_both_numbers():
    with pytest.raises(batch.BatchError, match=r"dp=8 \* tp=4 \* pp=1 \* cp=1 needs 32 ranks "
                                               r"but the job has 16 tasks"):
        batch.layout(LLAMA8B, [], 16)
    with pytest.raises(batch.BatchError, match="needs 4 ranks but the job has 8"):
        batch.layout(TINY, ["topology.dp=2", "topology.tp=2"], 8)


def test_an_open_dp_is_filled_in_from_the_tasks(tmp_path):
    cfg = tmp_path / "open.toml"
    cfg.write_text(Path(TINY).read_text())  # tiny-llama gives no topology.dp
    assert "dp" not in batch.explicit_keys(str(cfg), []) - {"topology.dp"}
    assert batch.layout(str(cfg), [], 4) == ["topology.dp=4"]
    assert batch.layout(str(cfg), ["topology.tp=2"], 8) == ["topology.dp=4"]
    assert batch.layout(str(cfg), ["topology.pp=2"], 2) == []  # 1 x 2 = 2: fits as is
    with pytest.raises(batch.BatchError, match="tp \\* pp \\* cp = 2 does not divide the "
                                               "job's 3 tasks"):
        batch.layout(str(cfg), ["topology.tp=2"], 3)


def test_a_legacy_or_overridden_dp_counts_as_given(tmp_path):
    cfg = tmp_path / "given.toml"
    cfg.write_text(Path(TINY).read_text() + "\n")
    assert "topology.dp" in batch.explicit_keys(str(cfg), ["topology.dp=1"])
    with pytest.raises(batch.BatchError, match="needs 1 ranks but the job has 4"):
        batch.layout(str(cfg), ["topology.dp=1"], 4)


def test_run_name_is_the_config_stem_or_given_never_the_job():
    assert run_name("share/configs/llama3-8b.toml") == "llama3-8b"
    assert run_name("x.toml", "my-run.2") == "my-run.2"
    with pytest.raises(ValueError, match="run name 'a b'"):
        run_name("x.toml", "a b")


def test_run_state_new_and_continuing(tmp_path):
    run = tmp_path / "run"
    assert "new run" in batch.preflight(TINY, [], 1, str(run)).splitlines()[1]
    ckpt = run / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "step_00000040.h5").write_bytes(b"")
    (ckpt / "latest").write_text("step_00000040.h5\n")
    out = batch.preflight(TINY, [], 1, str(run))
    assert "layout dp=1 (ep=1) x tp=1 x pp=1 x cp=1 = 1 ranks" in out
    assert "continues from step 40" in out, out
    with pytest.raises(Exception, match="would overwrite"):  # a fresh start over a run
        batch.preflight(TINY, ["checkpoint.resume=never"], 1, str(run))


def test_main_exits_2_with_one_message(capsys):
    assert batch.main(["layout", "--tasks", "3", LLAMA8B]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: ") and "needs 32 ranks but the job has 3 tasks" in err
    assert batch.main(["layout", "--tasks", "32", LLAMA8B, "--set", "train.steps=2"]) == 0
