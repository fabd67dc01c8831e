"""What a resume checks and carries over, without MPI: the inputs of the sample stream
(``lineage.check_resume``), the learning-rate decay horizon (``lineage.decay_horizon``) and
the schedule at and past that horizon (``optim.lr_at``)."""

import math
from pathlib import Path

import pytest

from hpctrain.checkpoint import lineage
from hpctrain.config import dumps_toml, load
from hpctrain.optim import lr_at

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny-llama.toml")


def cfg(*overrides):
    return load(TINY, list(overrides))


def saved(step=3, **attrs):
    """A checkpoint's attributes as restore returns them: the tiny preset's run, 5 steps."""
    out = {"step": step, "path": "ckpt.h5", "data_hash": "abc", "data_seed": 1234,
           "global_batch_size": 16, "seq_len": 16, "decay_steps": 5,
           "config": dumps_toml(cfg())}
    out.update(attrs)
    return {k: v for k, v in out.items() if v is not None}


def check(attrs, run_cfg, force=False, lines=None):
    t = run_cfg.train
    return lineage.check_resume(attrs, "abc", force, (lines if lines is not None else []).append,
                                seed=t.seed, global_batch=t.global_batch_size,
                                seq_len=t.seq_len)


# -- the inputs of the sample stream --------------------------------------------------------

def test_another_seq_len_is_refused_with_both_values_and_the_fix():
    with pytest.raises(lineage.LineageError) as e:
        check(saved(), cfg("train.seq_len=32"))
    msg = str(e.value)
    assert "the checkpoint's train.seq_len is 16, this run's is 32" in msg, msg
    assert "train.seq_len=16" in msg and "data.allow_changed=true" in msg, msg


def test_forced_seq_len_change_is_recorded():
    lines = []
    forced = check(saved(), cfg("train.seq_len=32"), force=True, lines=lines)
    assert forced == {"seq_len": {"from": 16, "to": 32}}
    assert any("train.seq_len is 16" in x for x in lines), lines


def test_micro_batch_and_layout_do_not_change_the_stream():
    assert check(saved(), cfg("train.micro_batch_size=4", "topology.dp=2")) is None


def test_a_checkpoint_without_the_attributes_is_checked_against_its_config():
    old = saved(seq_len=None, data_seed=None, global_batch_size=None)
    with pytest.raises(lineage.LineageError, match="train.seq_len is 16, this run's is 8"):
        check(old, cfg("train.seq_len=8"))
    with pytest.raises(lineage.LineageError, match=r"train.seed\) is 1234, this run's is 7"):
        check(old, cfg("train.seed=7"))
    assert check(old, cfg()) is None


def test_a_checkpoint_recording_neither_is_accepted_with_a_warning():
    old = {"step": 3, "path": "ckpt.h5", "data_hash": "abc"}
    lines = []
    assert check(old, cfg("train.seq_len=8"), lines=lines) is None
    assert len(lines) == 1 and "the checkpoint records no data seed" in lines[0], lines
    assert "train.seq_len: not checked" in lines[0], lines


def test_an_imported_checkpoint_at_step_0_is_not_checked_against_its_config():
    imported = {"step": 0, "path": "ckpt.h5", "data_hash": "",
                "config": dumps_toml(cfg("train.seq_len=64", "train.steps=100"))}
    lines = []
    assert check(imported, cfg(), lines=lines) is None and lines == []
    assert lineage.decay_horizon(cfg(), imported, lines.append) == (5, None)


# -- the learning-rate decay horizon ---------------------------------------------------------

def test_a_fresh_run_decays_over_train_steps_or_decay_steps():
    assert lineage.decay_horizon(cfg("train.steps=9"), None, print) == (9, None)
    assert lineage.decay_horizon(cfg("optim.decay_steps=4"), None, print) == (4, None)


@pytest.mark.parametrize("steps, tail", [(7, "steps 6-7 run at min_lr"),
                                         (4, "this run ends at step 4, before the decay")])
def test_a_resume_keeps_the_checkpoint_horizon_whatever_train_steps(steps, tail):
    lines = []
    assert lineage.decay_horizon(cfg(f"train.steps={steps}"), saved(), lines.append) == \
        (5, None)
    assert len(lines) == 1 and "after step 5" in lines[0] and tail in lines[0], lines


def test_an_explicit_decay_steps_changes_the_horizon_deliberately():
    lines = []
    got = lineage.decay_horizon(cfg("train.steps=9", "optim.decay_steps=9"), saved(),
                                lines.append)
    assert got == (9, {"from": 5, "to": 9})
    assert "optim.decay_steps=9 changes the checkpoint's decay horizon (5 steps)" in lines[0]
    same = lineage.decay_horizon(cfg("train.steps=9", "optim.decay_steps=5"), saved(), print)
    assert same == (5, None)


def test_an_older_checkpoint_takes_its_horizon_from_its_config():
    old = saved(decay_steps=None, config=dumps_toml(cfg("train.steps=6")))
    assert lineage.decay_horizon(cfg("train.steps=9"), old, print)[0] == 6
    old = saved(decay_steps=None, config=dumps_toml(cfg("optim.decay_steps=4")))
    assert lineage.decay_horizon(cfg("train.steps=9"), old, print)[0] == 4
    lines = []
    bare = {"step": 3, "path": "ckpt.h5"}
    assert lineage.decay_horizon(cfg("train.steps=9"), bare, lines.append) == (9, None)
    assert "records no decay horizon" in lines[0], lines


# -- the schedule at and past the horizon ----------------------------------------------------

@pytest.mark.parametrize("warmup, horizon", [(2, 5), (0, 5), (0, 1), (5, 5), (8, 5)])
def test_lr_reaches_min_lr_at_the_horizon_and_stays_there(warmup, horizon):
    o = cfg(f"optim.warmup_steps={warmup}").optim
    lrs = [lr_at(s, o, horizon) for s in range(40)]
    assert all(x == o.min_lr for x in lrs[horizon:]), lrs  # the horizon wins over warmup
    assert all(o.min_lr <= x <= o.lr for x in lrs)
    ramp = min(warmup, horizon)
    assert lrs[:ramp] == [o.lr * (s + 1) / warmup for s in range(ramp)], lrs
    after_warmup = lrs[ramp:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:])), lrs  # no jump up
    if warmup < horizon:
        assert lrs[warmup] == o.lr and lrs[horizon - 1] > o.min_lr


def test_lr_is_the_cosine_of_the_fraction_of_the_decay_done():
    o = cfg("optim.warmup_steps=2").optim
    for s in range(2, 5):
        want = o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * (s - 2) / 3))
        assert lr_at(s, o, 5) == pytest.approx(want, rel=1e-15)


def test_decay_steps_overrides_the_horizon_passed():
    o = cfg("optim.decay_steps=8").optim
    assert [lr_at(s, o, 5) for s in range(12)] == [lr_at(s, o, 8) for s in range(12)]
