"""``hpctrain train``'s checks of what a valid config points at (checks/inputs.check_inputs),
without MPI: the run and checkpoint directories, the checkpoint to resume from, the data."""

import os

import pytest

from hpctrain.checks import inputs
from hpctrain.config import ConfigError, InputError, load

TINY = "share/configs/tiny.toml"


def test_creatable_and_existing_directories_pass(tmp_path):
    inputs.check_inputs(load(TINY), str(tmp_path / "new" / "nested" / "run"))
    inputs.check_inputs(load(TINY, [f'checkpoint.dir="{tmp_path}"']), str(tmp_path))


def test_a_directory_that_cannot_be_written(tmp_path, monkeypatch):
    """A read-only parent (root may write anyway, so the permission answer is simulated)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(inputs.os, "access",
                        lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    with pytest.raises(InputError, match=f"--run-dir {ro}/run: {ro} is not writable"):
        inputs.check_inputs(load(TINY), str(ro / "run"))


def test_every_input_problem_is_reported_together(tmp_path):
    (tmp_path / "f").write_text("x")
    cfg = load(TINY, [f'checkpoint.dir="{tmp_path / "f"}"', 'checkpoint.resume="/no/ckpt.h5"',
                      f'data.path="{tmp_path / "none.h5"}"'])
    with pytest.raises(InputError) as e:
        inputs.check_inputs(cfg, str(tmp_path / "f" / "run"))
    text = str(e.value)
    assert text.startswith("invalid input:\n  - ")
    for part in (f"--run-dir {tmp_path}/f/run: {tmp_path}/f is not a directory",
                 f"checkpoint.dir={tmp_path}/f exists and is not a directory",
                 "checkpoint.resume='/no/ckpt.h5': no checkpoint there",
                 f"data.path={tmp_path}/none.h5 does not exist"):
        assert part in text, text


def test_plan_skips_a_data_file_that_is_not_here():
    cfg = load(TINY, ['data.path="/elsewhere/data.h5"'])
    assert inputs.data_problems(cfg, missing_ok=True) == []
    assert "does not exist" in inputs.data_problems(cfg)[0]


def test_init_from_must_exist_and_hold_this_model(tmp_path):
    """checkpoint.init_from: nothing there, a directory that is neither kind, a file that is
    not a checkpoint, and a checkpoint of another model: each named, before any collective."""
    import numpy as np

    from hpctrain.config import Config
    from hpctrain.interchange.hf_import import file_arrays, write_checkpoint

    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.h5").write_text("x")
    for source, words in ((tmp_path / "none", "nothing there"),
                          (tmp_path / "empty", "no format hpctrain reads .* no `latest`"),
                          (tmp_path / "junk.h5", "cannot be read")):
        with pytest.raises(InputError, match=words):
            inputs.check_inputs(load(TINY, [f'checkpoint.init_from="{source}"']),
                                   str(tmp_path / "run"))
    cfg = load(TINY)
    other = Config(model=cfg.model.__class__(**{**vars(cfg.model), "d_ff": 32}))
    ckpt = write_checkpoint(tmp_path / "other.h5", other,
                            file_arrays({"embed": np.zeros((256, 32))}, "float64"), {})
    with pytest.raises(InputError, match="model.d_ff = 64, the source has 32"):
        inputs.check_inputs(load(TINY, [f'checkpoint.init_from="{ckpt}"']),
                               str(tmp_path / "run"))


def test_a_missing_tokenizer_and_a_tokenizer_with_a_file_are_refused(tmp_path):
    cfg = load(TINY, [f'data.tokenizer="{tmp_path / "none.json"}"'])
    with pytest.raises(InputError, match=f"data.tokenizer: tokenizer {tmp_path}/none.json "
                       "does not exist"):
        inputs.check_inputs(cfg, str(tmp_path / "run"))
    from hpctrain.checks.validate import validate

    with pytest.raises(ConfigError, match="carries its own tokenizer"):
        validate(load(TINY, ['data.tokenizer="t.json"', 'data.path="d.h5"']), 1)


def test_a_fresh_start_over_committed_checkpoints_is_refused(tmp_path):
    """checkpoint.resume = "never" (or "") where checkpoints are, in the run directory or in
    checkpoint.dir: refused, saying how to continue and how to start anew; "auto" passes."""
    own, other = tmp_path / "run" / "checkpoints", tmp_path / "ckpt"
    for d in (own, other):
        d.mkdir(parents=True)
        (d / "step_00000004.h5").write_text("x")
    for extra, where in (([], own), ([f'checkpoint.dir="{other}"'], other)):
        for value in ('""', '"never"'):
            with pytest.raises(InputError) as e:
                inputs.check_inputs(load(TINY, [*extra, f"checkpoint.resume={value}"]),
                                    str(tmp_path / "run"))
            text = str(e.value)
            for part in (f"{where} holds 1 checkpoint(s)", "step_00000004.h5",
                         "checkpoint.resume=auto", "another --run-dir", "move the checkpoints"):
                assert part in text, text
        inputs.check_inputs(load(TINY, extra), str(tmp_path / "run"))  # auto: continues
