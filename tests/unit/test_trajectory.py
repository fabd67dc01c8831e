"""The checkpoint directory's trajectory (checkpoint/trajectory.py) without MPI: the commit
log's replay, a start that sets aside what the run does not continue, retention and the
resume candidates along the trajectory, and a directory written before the log existed."""

import json
from dataclasses import replace

import torch
from fakes import fake_topology

from hpctrain.checkpoint import checkpointer, trajectory
from hpctrain.config import CheckpointConfig, OptimConfig
from hpctrain.model.stage import ParamMeta
from hpctrain.optim.adamw import AdamW


def _name(step: int) -> str:
    return f"step_{step:08d}.h5"


def _files(d, *steps):
    d.mkdir(parents=True, exist_ok=True)
    for s in steps:
        (d / _name(s)).write_text(f"checkpoint {s}")


def test_a_directory_without_log_is_one_trajectory_in_step_order(tmp_path):
    _files(tmp_path, 6, 2, 4)
    assert trajectory.trajectory(tmp_path) == [_name(2), _name(4), _name(6)]
    assert checkpointer.candidates("auto", tmp_path) == [tmp_path / _name(s) for s in (6, 4, 2)]


def test_start_from_an_older_checkpoint_sets_the_newer_aside_and_seeds_the_log(tmp_path):
    _files(tmp_path, 2, 4, 6)
    (tmp_path / "latest").write_text(_name(6) + "\n")
    moved, where = trajectory.start(tmp_path, _name(2), "f")
    assert moved == [_name(4), _name(6)] and where == tmp_path / "abandoned" / "f"
    assert sorted(p.name for p in where.iterdir()) == moved
    assert (where / _name(6)).read_text() == "checkpoint 6"  # moved, not rewritten
    assert (tmp_path / "latest").read_text().strip() == _name(2)
    events = [json.loads(x) for x in (tmp_path / trajectory.LOG).read_text().splitlines()]
    assert [(e["event"], e.get("file")) for e in events] == [("commit", _name(2)),
                                                             ("start", None)]
    assert events[-1]["set_aside"] == moved and events[-1]["to"] == "abandoned/f"
    # the new trajectory's commits; a torn last line is ignored
    _files(tmp_path, 3, 4)
    for s in (3, 4):
        trajectory.append(tmp_path, {"event": "commit", "file": _name(s)})
    with open(tmp_path / trajectory.LOG, "a") as fh:
        fh.write('{"event": "comm')
    assert trajectory.trajectory(tmp_path) == [_name(2), _name(3), _name(4)]
    # a file no commit names (copied in) is on no trajectory: never a candidate
    _files(tmp_path, 9)
    assert checkpointer.candidates("auto", tmp_path)[0] == tmp_path / _name(4)


def test_a_start_from_elsewhere_or_fresh_sets_everything_aside(tmp_path):
    _files(tmp_path, 1, 2)
    (tmp_path / "latest").write_text(_name(2) + "\n")
    moved, _ = trajectory.start(tmp_path, None, "g")
    assert moved == [_name(1), _name(2)] and not (tmp_path / "latest").exists()
    assert trajectory.trajectory(tmp_path) == []
    assert trajectory.start(tmp_path / "none", None, "h") == ([], tmp_path / "none/abandoned/h")


def test_retention_keeps_the_newest_of_the_trajectory(tmp_path, monkeypatch):
    """Steps 1-4 saved, the run resumes from step 2 with keep = 2 and saves 3 and 4: the
    directory holds the new 3 and 4, the old 3 and 4 are set aside, 1 and 2 pruned."""
    monkeypatch.setenv(checkpointer.SERIAL_ENV, "1")
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    p.hp = ParamMeta((4, 3))
    opt = AdamW([("w", p)], OptimConfig())
    cfg = replace(CheckpointConfig(), keep=0)
    saver = checkpointer.Checkpointer(cfg, fake_topology(), tmp_path, warn=lambda m: None)
    for s in (1, 2, 3, 4):
        saver.save(s, [("w", p)], opt, {})
    saver.wait()
    saver = checkpointer.Checkpointer(replace(cfg, keep=2), fake_topology(), tmp_path,
                                      warn=lambda m: None)
    folder, said = saver.take_over({"path": str(tmp_path / _name(2))}, 2)
    assert "2 checkpoint(s)" in said and folder in said
    for s in (3, 4):
        saver.save(s, [("w", p)], opt, {})
    saver.wait()
    assert sorted(x.name for x in tmp_path.glob("step_*.h5")) == [_name(3), _name(4)]
    assert sorted(x.name for x in (tmp_path / "abandoned" / folder).iterdir()) == \
        [_name(3), _name(4)]
    assert checkpointer.latest(tmp_path) == tmp_path / _name(4)


def test_metrics_after_the_start_step_are_set_aside(tmp_path, capsys):
    """metrics.jsonl keeps the records up to the step the run continues from; the later ones
    (and a torn last line) move to abandoned/<folder>/metrics.jsonl; new records append."""
    from hpctrain.telemetry import RunLog

    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)] + ['{"step": 7, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    log = RunLog(tmp_path, fake_topology(), 4)
    log.continue_at(2, "f")
    log.continue_at(2, "f")  # nothing left to set aside: nothing happens
    log._metrics.write(json.dumps({"step": 3, "loss": 0.5}) + "\n")
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (tmp_path / "abandoned/f/metrics.jsonl").read_text().splitlines() == lines[2:]
    assert "5 record(s) of metrics.jsonl after step 2 set aside" in capsys.readouterr().out
