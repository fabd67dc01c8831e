"""What a resume refuses and what it carries over, through the real CLI.

Refused (exit 2 on every rank, one line naming what differs, before a step is taken and with
nothing written into the checkpoint directory): another data seed, global batch size or
sequence length than the checkpoint's (unless ``data.allow_changed``, which lineage.json
records), a checkpoint of another model's shape, a checkpoint that lacks a tensor. Carried
over: float16's dynamic loss scale and its growth tracker; the learning-rate schedule's decay
horizon, whatever ``train.steps`` the resumed run sets.
"""

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from launch import TINY, mpirun, read_params, read_run, train_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 5-step run's checkpoint directory (tiny preset, seed 1234, global batch 16,
    seq_len 16), saved at steps 3 and 5; its metrics are the uninterrupted reference."""
    run = train_cli(tmp_path_factory.mktemp("saved") / "run", 1, "checkpoint.every=3")
    return run.run_dir / "checkpoints"


def _snapshot(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _refused(run_dir: Path, ckpt_dir: Path, *overrides: str, n: int = 2):
    """Resume from ``ckpt_dir`` (also the directory new checkpoints would go to); returns
    the stderr lines of the refusal after checking the exit code and that nothing changed."""
    before = _snapshot(ckpt_dir)
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("# the earlier run's config\n")
    args = ["-m", "hpctrain", "train", TINY, "--run-dir", str(run_dir), "--set",
            f"topology.dp={n}", "--set", "checkpoint.resume=auto", "--set",
            f"checkpoint.dir={ckpt_dir}"]
    for o in overrides:
        args += ["--set", o]
    proc = mpirun(n, args, check=False, timeout=240)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[:3000], proc.stderr[-2000:])
    # (python -m mpi4py turns exit status 2 into MPI_Abort(2): Open MPI's banner follows)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hpctrain train:")]
    assert len(lines) == 1, proc.stderr  # one clear line (rank 0), every rank exits 2
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl") \
        .read_text().strip(), "a step was taken"
    assert _snapshot(ckpt_dir) == before, "the checkpoint directory changed"
    assert (run_dir / "config.toml").read_text() == "# the earlier run's config\n"
    return lines[0]


@pytest.mark.parametrize("override, named", [
    ("train.seed=99", ("data seed (train.seed) is 1234", "this run's is 99")),
    ("train.global_batch_size=32", ("train.global_batch_size is 16", "this run's is 32")),
    ("train.seq_len=32", ("train.seq_len is 16", "this run's is 32", "train.seq_len=16"))])
def test_resume_with_another_seed_global_batch_or_seq_len_is_refused(tmp_path, saved, override,
                                                             named):
    line = _refused(tmp_path / "run", saved, override)
    assert "refusing to resume" in line and "data.allow_changed" in line, line
    for text in named:
        assert text in line, line


def test_allow_changed_resumes_and_records_the_change(tmp_path, saved):
    run = train_cli(tmp_path / "run", 2, "topology.dp=2", "train.seed=99",
                    "train.global_batch_size=32", "train.seq_len=8", "data.allow_changed=true",
                    f"checkpoint.resume={saved / 'step_00000003.h5'}")
    assert [m["step"] for m in run.metrics] == [4, 5]
    assert "resuming on different data (forced)" in run.stdout and "is 99" in run.stdout
    forced = json.loads((run.run_dir / "lineage.json").read_text())["forced_data_change"]
    assert forced["data_seed"] == {"from": 1234, "to": 99}, forced
    assert forced["global_batch_size"] == {"from": 16, "to": 32}, forced
    assert forced["seq_len"] == {"from": 16, "to": 8}, forced
    assert "from" not in forced  # the data itself did not change
    with h5py.File(run.run_dir / "checkpoints" / "step_00000005.h5", "r") as f:
        assert f.attrs["data_seed"] == 99 and f.attrs["global_batch_size"] == 32
        assert f.attrs["seq_len"] == 8


def test_longer_train_steps_keep_the_decay_horizon(tmp_path, saved):
    """Resuming step 3 of a 5-step run with train.steps=7: steps 4 and 5 get the learning
    rates of the uninterrupted run (its horizon, 5 steps, comes from the checkpoint, not
    from train.steps), steps 6 and 7 min_lr; the log says so."""
    ref = read_run(saved.parent).metrics
    run = train_cli(tmp_path / "run", 1, "train.steps=7",
                    f"checkpoint.resume={saved / 'step_00000003.h5'}")
    assert [m["step"] for m in run.metrics] == [4, 5, 6, 7]
    assert [m["lr"] for m in run.metrics[:2]] == [m["lr"] for m in ref[3:5]], (run.metrics,
                                                                                ref)
    assert [m["lr"] for m in run.metrics[2:]] == [2e-4, 2e-4]  # the preset's min_lr
    line = [x for x in run.stdout.splitlines() if "learning-rate schedule" in x]
    assert len(line) == 1 and "step 5" in line[0] and "steps 6-7 run at min_lr" in line[0], \
        run.stdout
    with h5py.File(run.run_dir / "checkpoints" / "step_00000007.h5", "r") as f:
        assert f.attrs["decay_steps"] == 5


@pytest.mark.parametrize("override, problem", [
    ("model.d_ff=48", "another model (model.d_ff: 64 in the checkpoint, 48 in the config)"),
    ("model.n_layers=4", "another model (model.n_layers: 8 in the checkpoint, 4 in the "
                         "config)")])
def test_checkpoint_of_another_model_is_refused(tmp_path, saved, override, problem):
    """The keys that differ, not every dataset that does not fit."""
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    line = _refused(tmp_path / "run", d, override)
    assert problem in line and "dataset" not in line, line


def test_other_data_is_refused_naming_what_changed(tmp_path, saved):
    """Another corpus: the refusal names the data lineage that changed, and train.log does
    not end on 'resumed from' (the refusal comes first)."""
    line = _refused(tmp_path / "run", saved, "data.corpus_mb=1")
    assert "the checkpoint was trained on other data (" in line and "content hash" in line
    assert "documents 21 -> 49" in line, line  # what differs in the data lineage
    log = tmp_path / "run" / "train.log"
    assert not log.exists() or "resumed from" not in log.read_text()


def test_checkpoint_missing_a_dataset_is_refused(tmp_path, saved):
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    with h5py.File(d / (d / "latest").read_text().strip(), "r+") as f:
        del f["optim/blocks.2.attn.wq/exp_avg"]  # the other checksums stay valid
    line = _refused(tmp_path / "run", d)
    assert "the checkpoint has no dataset optim/blocks.2.attn.wq/exp_avg" in line, line


F16 = ('model.dtype="float16"', "optim.loss_scale=1048576", "topology.dp=2", "optim.zero=1",
       "train.steps=6")


def _scaler_after(metrics) -> dict:
    """The loss scaler's state after these steps, from their records."""
    good = 0
    for prev, x in zip([{"skipped_steps": 0}] + metrics, metrics):
        good = 0 if x["skipped_steps"] > prev["skipped_steps"] else good + 1
    return {"loss_scaler_scale": metrics[-1]["loss_scale"], "loss_scaler_good_steps": good,
            "loss_scaler_skipped": metrics[-1]["skipped_steps"]}


def test_fp16_loss_scale_is_saved_and_restored(tmp_path):
    """float16 with an initial scale that overflows (skipped steps, scale halved) before the
    save at step 3: 3 steps, save, resume, 3 more equal 6 straight, the scale, its growth
    tracker and the skip count included."""
    straight = train_cli(tmp_path / "straight", 2, *F16, "checkpoint.every=3")
    m = straight.metrics
    assert m[2]["skipped_steps"] >= 1 and m[2]["loss_scale"] < 1048576, m[:3]
    step3 = straight.run_dir / "checkpoints" / "step_00000003.h5"
    with h5py.File(step3, "r") as f:
        saved = {k: f.attrs[k] for k in f.attrs if k.startswith("loss_scaler_")}
    assert saved == _scaler_after(m[:3]), (saved, m[:3])
    resumed = train_cli(tmp_path / "resumed", 2, *F16, f"checkpoint.resume={step3}")
    keys = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps")
    assert [[repr(r[k]) for k in keys] for r in resumed.metrics] == \
        [[repr(r[k]) for k in keys] for r in m[3:]]
    a = read_params(straight.run_dir / "checkpoints" / "step_00000006.h5", "")
    b = read_params(resumed.run_dir / "checkpoints" / "step_00000006.h5", "")
    a.pop("rng/torch"), b.pop("rng/torch")
    assert set(a) == set(b) and any(k.endswith("/master") for k in a)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    for run in (straight, resumed):
        with h5py.File(run.run_dir / "checkpoints" / "step_00000006.h5", "r") as f:
            got = {k: f.attrs[k] for k in f.attrs if k.startswith("loss_scaler_")}
        assert got == _scaler_after(m), (run.run_dir, got)
