"""A config or its inputs are refused before torch is imported (a refusal costs the start-up
of Python, not of torch, on every rank), and the refusals' messages: a one-rank world for a
layout of several ranks says how to launch, every telemetry key has its bound."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hpctrain.checks.validate import validate
from hpctrain.config import Config, ConfigError, load

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "share/configs/tiny.toml")


def test_train_refuses_config_and_inputs_without_importing_torch(tmp_path):
    """``hpctrain train`` with a refused config, then refused inputs (a data file that is not
    there, a checkpoint of another model to initialise from), then the checks of a config
    that passes them: torch is not imported by any of them."""
    from hpctrain.interchange.hf_import import file_arrays, write_checkpoint

    cfg = load(TINY)
    other = Config(model=cfg.model.__class__(**{**vars(cfg.model), "d_ff": 32}))
    ckpt = write_checkpoint(tmp_path / "other.h5", other,
                            file_arrays({"embed": np.zeros((256, 32))}, "float64"), {})
    script = textwrap.dedent(f"""
        import sys
        from hpctrain.__main__ import main
        run = ["train", {TINY!r}, "--run-dir", {str(tmp_path / "run")!r}, "--set"]
        assert main(run + ["telemetry.watchdog_s=-1"]) == 2
        assert main(run + ['checkpoint.init_from="{ckpt}"', "--set",
                           'data.path="{tmp_path / "none.h5"}"']) == 2
        from hpctrain.checks.inputs import check_inputs
        from hpctrain.checks.validate import validate
        from hpctrain.config import load
        cfg = load({TINY!r})
        validate(cfg, 1)
        check_inputs(cfg, {str(tmp_path / "run")!r})
        print("torch imported:", "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "torch imported: False" in proc.stdout
    assert "telemetry.watchdog_s=-1.0 must be >= 0" in proc.stderr
    assert "model.d_ff = 64, the source has 32" in proc.stderr, proc.stderr


def test_one_rank_world_says_how_to_launch_the_layout():
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, ["topology.dp=2", "topology.tp=2"]), 1)
    text = str(e.value)
    assert "this layout needs 4 ranks" in text, text
    assert "`mpirun -n 4 hpctrain train ...`" in text and "`srun -n 4 hpctrain train ...`" in text
    assert "so that the product is 1" not in text


@pytest.mark.parametrize("override,message", [
    ("telemetry.watchdog_s=-1", "telemetry.watchdog_s=-1.0 must be >= 0"),
    ("telemetry.watchdog_factor=-0.5", "telemetry.watchdog_factor=-0.5 must be >= 0"),
    ("telemetry.peak_flops=-1e12", "telemetry.peak_flops=-1000000000000.0 must be >= 0"),
    ("telemetry.max_skips=-1", "telemetry.max_skips=-1 must be >= 0"),
    ("telemetry.loss_spike=-2", "telemetry.loss_spike=-2.0 must be >= 0"),
    ("telemetry.loss_spike=0.5", "telemetry.loss_spike=0.5 must be 0 (off) or > 1"),
    ('telemetry.trace_steps="3-1"', "telemetry.trace_steps='3-1': need 1 <= A <= B"),
    ('telemetry.trace_steps="x"', "telemetry.trace_steps='x': expected 'A-B', 'N' or 'all'"),
    ("train.eval_batches=-1", "train.eval_batches=-1 must be >= 0"),
])
def test_telemetry_and_unbounded_keys_are_checked_with_the_config(override, message):
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, [override]), 1)
    assert message in str(e.value), str(e.value)
