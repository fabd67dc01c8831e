"""Held-out data through the CLI: lineage refusals, stop rules and the split. The held-out
loss on other layouts (and generation from their checkpoints) runs in
tests/matrix/test_eval_layouts.py."""

import json

import pytest
from launch import TINY, hpctrain

pytestmark = pytest.mark.e2e


def test_resume_on_changed_data_is_refused_unless_forced(tmp_path):
    run_dir = tmp_path / "run"
    common = ["train", TINY, "--run-dir", str(run_dir), "--set", "train.steps=2"]
    hpctrain(common)
    again = common + ["--set", "train.steps=3", "--set", "checkpoint.resume=\"auto\"",
                      "--set", "data.corpus_mb=0.4"]  # a different corpus: another hash
    refused = hpctrain(again, check=False)
    assert refused.returncode == 2
    assert "refusing to resume" in refused.stderr and "data.allow_changed" in refused.stderr
    forced = hpctrain(again + ["--set", "data.allow_changed=true"])
    assert "resuming on different data (forced)" in forced.stdout
    lineage = json.loads((run_dir / "lineage.json").read_text())
    assert lineage["forced_data_change"]["from"] != lineage["forced_data_change"]["to"]
    assert lineage["data"]["content_hash"] == lineage["forced_data_change"]["to"]
    assert lineage["versions"]["torch"] and "commit" in lineage
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("rule,overrides,reason", [
    ("target", ["train.eval_every=1", "train.target_val_loss=100.0"],
     "target validation loss 100.0 reached"),
    ("patience", ["train.eval_every=1", "train.patience=1", "optim.lr=0.0", "optim.min_lr=0.0"],
     "no improvement of the validation loss for 1 evaluations"),
    ("wall", ["train.max_wall_s=0.001"], "wall-time budget train.max_wall_s=0.001 s reached"),
])
def test_stop_rules_end_with_reason_and_checkpoint(tmp_path, rule, overrides, reason):
    run_dir = tmp_path / rule
    args = ["train", TINY, "--run-dir", str(run_dir), "--set", "data.val_fraction=0.2"]
    for o in overrides:
        args += ["--set", o]
    out = hpctrain(args)
    stop_lines = [x for x in out.stdout.splitlines() if "stopping at step" in x]
    assert len(stop_lines) == 1 and reason in stop_lines[0], out.stdout
    step = int(stop_lines[0].split("stopping at step ")[1].split(":")[0])
    assert step < 5
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{step:08d}.h5"
    # and it loads: resume from it runs the remaining steps
    hpctrain(["train", TINY, "--run-dir", str(run_dir), "--set", "data.val_fraction=0.2",
              "--set", "checkpoint.resume=\"auto\""])
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5


def test_prepare_split_is_stable(tmp_path):
    out1, out2 = tmp_path / "a.h5", tmp_path / "b.h5"
    hpctrain(["prepare", "--out", str(out1), "--corpus-mb", "0.3", "--val-fraction", "0.2"])
    hpctrain(["prepare", "--out", str(out2), "--corpus-mb", "0.3", "--val-fraction", "0.2"])
    import h5py

    with h5py.File(out1) as a, h5py.File(out2) as b:
        assert a.attrs["content_hash"] == b.attrs["content_hash"]
        assert (a["val/tokens"][...] == b["val/tokens"][...]).all()
        assert a["val/tokens"].shape[0] > 0 and a.attrs["tokenizer"] == "bytes"
