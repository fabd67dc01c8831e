"""``hpctrain report`` on a synthetic run directory (no MPI): plots, summary, and the
message when matplotlib is missing."""

import json
import sys

from hpctrain.__main__ import main


def fake_run(d):
    d.mkdir()
    lines = []
    for step in (1, 2, 3):
        lines.append({"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0,
                      "step_time_s": 0.5, "tokens_per_s": 512.0, "skipped": step == 2,
                      "skips_total": int(step >= 2), "rollbacks": 0,
                      "time_s": {"compute": 0.3, "comm_dp": 0.15, "other": 0.05},
                      "flops_per_token": 1e6, "tflops_per_rank": 1e-4, "mfu": 0.01,
                      "step_s_min": 0.49, "step_s_median": 0.5, "step_s_max": 0.51,
                      "ranks": {"step_s": [0.5, 0.5], "busy_s": [0.2, 0.4]},
                      "straggler": {"rank": 1, "name": "rank 1 (pp=0, dp=1, ep=0, tp=0)",
                                    "busy_s": 0.4, "median_busy_s": 0.3, "min_busy_s": 0.2}})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    events = [{"name": n, "cat": c, "ph": "X", "pid": r, "tid": 0, "ts": ts, "dur": 100.0,
               "args": {"step": 2}}
              for r in (0, 1) for n, c, ts in (("F0", "action", 0.0), ("B0", "action", 150.0),
                                               ("iallreduce", "comm", 260.0))]
    (d / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (d / "watchdog").mkdir()
    (d / "watchdog" / "summary.txt").write_text("hpctrain watchdog: no progress for 5 s\n")
    return d


def test_report_writes_every_png_and_the_summary(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    assert main(["report", str(run), "--step", "2"]) == 0
    for png in ("loss_lr.png", "breakdown.png", "ranks.png", "timeline.png"):
        assert (run / "report" / png).read_bytes()[:4] == b"\x89PNG"
    md = (run / "report" / "summary.md").read_text()
    assert "skipped updates 1" in md and "rank 1 (pp=0, dp=1, ep=0, tp=0)" in md
    assert "| compute | 0.3000 | 60.0% |" in md
    assert "- step 2: ?" in md and "hpctrain watchdog: no progress for 5 s" in md
    assert main(["report", str(run), "--step", "7"]) == 2
    assert "step 7 is not in the trace" in capsys.readouterr().err


def test_report_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 1
    assert "pip install 'hpctrain[report]'" in capsys.readouterr().err
    assert (tmp_path / "out" / "summary.md").is_file()
    assert not list((tmp_path / "out").glob("*.png"))


def test_a_resumed_runs_wall_time_adds_its_earlier_invocations(tmp_path, capsys):
    """Three invocations of one run (the third resumed twice): summary.json and the report
    give this invocation's wall time and the run's; a fresh start does not add."""
    from types import SimpleNamespace

    from hpctrain.telemetry.summary import RunSummary

    run = fake_run(tmp_path / "run")
    log = SimpleNamespace(is_writer=True, info=lambda _m: None)
    for start, wall in ((0, 10.0), (3, 20.0), (5, 30.5)):
        s = RunSummary(start, 64)
        s.add({"step": start + 1, "loss": 1.0})
        out = s.finish(log, run, "train.steps reached", None, wall)
    assert (out["wall_s"], out["run_wall_s"], out["invocations"]) == (30.5, 60.5, 3)
    assert main(["report", str(run)]) == 0
    md = (run / "report" / "summary.md").read_text()
    assert "wall time 30.5 s (this invocation; 60.5 s over the run's 3 invocations" in md
    fresh = RunSummary(0, 64).finish(log, run, "train.steps reached", None, 4.0)
    assert (fresh["run_wall_s"], fresh["invocations"]) == (4.0, 1)
