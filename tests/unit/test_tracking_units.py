"""Pieces of experiment tracking, MFU's denominator and the report's layouts, without MPI:
which peak MFU divides by, the refusals before any collective, the numbers a tracker gets,
and the report's per-layout segments."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpctrain.checks.inputs import check_inputs, tracking_problems
from hpctrain.cli.report import segments, summary_md
from hpctrain.config import InputError, load
from hpctrain.planner.cluster import ClusterError, mfu_peak
from hpctrain.telemetry.tracking import offline_environment, scalars

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "share/configs/tiny-llama.toml")


def test_mfu_peak_comes_from_the_key_then_the_cluster_else_none():
    assert mfu_peak(2e12, "dgx-a100", "bfloat16") == (2e12, "telemetry.peak_flops")
    assert mfu_peak(0.0, "dgx-a100", "bfloat16") == (312e12, "cluster dgx-a100 (bfloat16)")
    assert mfu_peak(0.0, "", "float32") == (None, "no telemetry.peak_flops or telemetry.cluster")
    with pytest.raises(ClusterError, match="no such file or shipped description"):
        mfu_peak(0.0, "nowhere", "float32")


def test_a_cluster_without_the_models_dtype_is_refused(tmp_path):
    text = (ROOT / "share/clusters/dgx-a100.toml").read_text()
    f = tmp_path / "no-fp64.toml"
    f.write_text("\n".join(x for x in text.splitlines() if not x.startswith("float64")))
    assert mfu_peak(0.0, str(f), "bfloat16")[0] == 312e12
    with pytest.raises(ClusterError, match="no peak_flops.float64"):
        mfu_peak(0.0, str(f), "float64")


def test_missing_tracker_packages_are_named_with_the_fix():
    cfg = load(TINY, ["telemetry.tensorboard=true", 'telemetry.wandb="offline"'])
    assert tracking_problems(cfg, installed=lambda name: True) == []
    tb, wb = tracking_problems(cfg, installed=lambda name: False)
    assert "telemetry.tensorboard=True needs the tensorboard package" in tb
    assert "pip install 'hpctrain[tracking]'" in tb and "telemetry.tensorboard=false" in tb
    assert "telemetry.wandb='offline' needs the wandb package" in wb and "telemetry.wandb=''" in wb
    assert tracking_problems(load(TINY), installed=lambda name: False) == []


def test_train_refuses_a_cluster_it_cannot_read(tmp_path):
    """Exit 2 with the key, the reason and the fix; no run directory made."""
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", TINY, "--run-dir",
                           str(tmp_path / "run"), "--set", 'telemetry.cluster="nowhere"'],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "telemetry.cluster='nowhere': cluster 'nowhere': no such file" in proc.stderr
    assert "or set telemetry.peak_flops" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_input_checks_refuse_a_missing_tracker(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(InputError, match="telemetry.wandb='offline' needs the wandb package"):
        check_inputs(load(TINY, ['telemetry.wandb="offline"']), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


numbers = st.one_of(st.integers(-9, 9), st.floats(allow_nan=True, width=16))
names = st.sampled_from(["loss", "lr", "time_s", "mem", "ranks", "run_start", "x"])
values = st.one_of(numbers, st.booleans(), st.just("text"),
                   st.dictionaries(st.sampled_from(["a", "b"]), numbers, max_size=2))


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(names, values, max_size=4))
def test_scalars_are_every_finite_number_one_level_deep(record):
    want = {}
    for k, v in record.items():
        if k in ("ranks", "run_start"):
            continue
        for inner, x in (v.items() if isinstance(v, dict) else [(None, v)]):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                want[k if inner is None else f"{k}/{inner}"] = float(x)
    assert scalars({"step": 3, **record}) == want


def record(step, world, layout=None):
    m = {"step": step, "loss": 5.0, "lr": 1e-3, "step_time_s": 0.1 * world,
         "tokens_per_s": 100.0 * world, "time_s": {"compute": 0.1},
         "ranks": {"step_s": [0.1] * world, "busy_s": [0.1] * world}}
    if layout:
        m["run_start"] = {"layout": layout, "world_size": world}
    return m


def test_report_keeps_each_layout_apart(tmp_path):
    metrics = ([record(1, 2, "pp=1 dp=2"), record(2, 2), record(3, 2, "pp=1 dp=2")]
               + [record(4, 1, "pp=1 dp=1"), record(5, 1)])
    parts = segments(metrics)
    assert [(layout, [m["step"] for m in recs]) for layout, recs in parts] == [
        ("pp=1 dp=2", [1, 2, 3]), ("pp=1 dp=1", [4, 5])]  # a resume on the same layout: one
    md = summary_md(tmp_path, metrics, [])
    assert "- steps 1..3 on pp=1 dp=2: mean step time 0.2000 s" in md, md
    assert "- steps 4..5 on pp=1 dp=1: mean step time 0.1000 s" in md, md
    assert "## Per rank on pp=1 dp=1" in md and "| 1 |" not in md
    old = [record(1, 1), record(2, 1, "pp=1 dp=1")]  # records from before layouts were named
    assert [layout for layout, _ in segments(old)] == ["pp=1 dp=1"]


def test_wandb_is_kept_offline_and_inside_the_run_directory(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR",
                 "WANDB_SILENT", "WANDB_CONSOLE", "WANDB_DISABLE_CODE", "WANDB_DISABLE_GIT"):
        monkeypatch.delenv(name, raising=False)
    env = offline_environment(tmp_path)
    assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(tmp_path)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        assert Path(env[name]).is_relative_to(tmp_path)
    assert all(os.environ[k] == v for k, v in env.items())


def test_wandb_leaves_the_excepthook_that_ends_the_job(tmp_path, monkeypatch):
    import sys

    from hpctrain.config import load
    from hpctrain.telemetry.tracking import Trackers

    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    ours = lambda *exc: None  # noqa: E731 (stands for comm.abort_on_exception's hook)
    monkeypatch.setattr(sys, "excepthook", ours)
    cfg = load(None, ['telemetry.wandb="offline"'])
    trackers = Trackers(cfg, tmp_path, "", {"commit": "x"}, is_writer=True)
    try:
        assert sys.excepthook is ours  # wandb.init installs its own; one traceback, then abort
    finally:
        trackers.wb.finish()
