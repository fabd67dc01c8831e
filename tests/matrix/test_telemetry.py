"""Where the time went, in one launch: breakdown, MFU, stragglers, trace, report."""

import json

import pytest
from inprocess import train_layout, world
from launch import TINY

from hpctrain.__main__ import main as hpctrain_main
from hpctrain.config import load
from hpctrain.planner.flops import train_flops_per_token

SLOW_RANK = 3  # world rank slowed on purpose: (pp=0, dp=1, ep=0, tp=1) on dp=2 x tp=2


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """4 ranks (dp=2 x tp=2), 3 steps, every step traced, rank 3 sleeping 4 s per step
    (more than a loaded machine takes from another rank), MFU against the cpu-epyc-7763
    description's peak."""
    d = tmp_path_factory.mktemp("telemetry") / "run"
    return train_layout(d, 4, "topology.dp=2", "topology.tp=2", "train.steps=3",
                     "telemetry.trace=true", 'telemetry.trace_steps="all"',
                     f'experimental.faults="slow@{SLOW_RANK}:1:4"',
                     'telemetry.cluster="cpu-epyc-7763"')  # MFU's nominal peak


def test_breakdown_adds_up_and_names_every_axis(traced):
    for m in traced.metrics:
        parts = m["time_s"]
        assert all(v >= -1e-6 for v in parts.values()), parts
        # An accounting identity, not a timing: categories + exposed comm + other = step.
        assert abs(sum(parts.values()) - m["step_time_s"]) <= 0.02 * m["step_time_s"], parts
        assert {"data", "compute", "grad_sync", "optimizer", "comm_dp", "comm_tp"} <= set(parts)
        assert m["comm_bytes"]["dp"] > 0 and m["comm_bytes"]["tp"] > 0


def test_throughput_and_mfu(traced):
    cfg = load(TINY, ["train.steps=3"])
    fpt = train_flops_per_token(cfg.model, cfg.train.seq_len)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    for m in traced.metrics:
        assert m["flops_per_token"] == pytest.approx(fpt)
        assert m["tokens_per_s"] == pytest.approx(tokens / m["step_time_s"])
        assert m["tflops_per_rank"] * 1e12 == pytest.approx(fpt * tokens / m["step_time_s"] / 4)
        assert 0 < m["mfu"] < 1


def test_straggler_report_names_the_slowed_rank(traced):
    for m in traced.metrics:
        s = m["straggler"]
        assert s["rank"] == SLOW_RANK, m["ranks"]
        assert "(pp=0, dp=1, ep=0, tp=1)" in s["name"]
        assert m["step_s_min"] <= m["step_s_median"] <= m["step_s_max"]
        assert len(m["ranks"]["busy_s"]) == 4
    assert f"slowest rank {SLOW_RANK} (pp=0, dp=1, ep=0, tp=1)" in traced.stdout


def test_trace_is_chrome_json_with_every_rank(traced):
    trace = json.loads((traced.run_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert {e["args"]["step"] for e in events} == {1, 2, 3}
    for e in events:
        assert e["dur"] >= 0 and isinstance(e["ts"], float) and isinstance(e["tid"], int)
    comm = [e for e in events if e["cat"] == "comm"]
    assert {e["args"]["axis"] for e in comm} >= {"dp", "tp"}
    assert all(e["args"]["bytes"] >= 0 for e in comm)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "rank 3 (pp=0, dp=1, ep=0, tp=1)" in names
    assert not (traced.run_dir / "trace").exists()  # per-rank parts merged and removed


def test_report_renders_pngs_and_summary(traced, capsys):
    if world().rank != 0:  # one process writes the report (rank 0's verdict is everyone's)
        return
    out = traced.run_dir / "report"
    assert hpctrain_main(["report", str(traced.run_dir)]) == 0
    for png in ("loss_lr.png", "breakdown.png", "ranks.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, png
    summary = (out / "summary.md").read_text()
    assert f"slowest rank (last interval): rank {SLOW_RANK}" in summary
    assert "| comm_dp |" in summary and "MFU" in summary


def test_report_rejects_a_directory_without_metrics(tmp_path, capsys):
    assert hpctrain_main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_metric_collectives_run_on_logging_steps_only(tmp_path, monkeypatch):
    """pp=2 x ep=2 with experts, log_every=3: steps 1 and 2 exchange nothing for metrics
    (no object gathers; the same world operations as each other), step 3 gathers the
    stragglers, the pipeline timing and the MoE statistics (the recording communicator)."""
    from hpctrain.telemetry.metrics import Telemetry

    ops: list = []  # (step, op, axis) of every completed operation on this rank
    begin = Telemetry.begin_step

    def recording_begin(self, step):
        begin(self, step)
        if not ops and not getattr(self.topo.recorder, "_test_listening", False):
            self.topo.recorder._test_listening = True
            self.topo.recorder.listeners.append(lambda r: ops.append((self._step, r.op,
                                                                      r.axis)))
        self._step = step

    monkeypatch.setattr(Telemetry, "begin_step", recording_begin)
    run = train_layout(tmp_path / "run", 4, "topology.pp=2", "topology.dp=2", "topology.ep=2",
                       "model.num_experts=4", "model.moe_every=2", "train.steps=3",
                       "train.log_every=3", "train.eval_every=0")
    assert [("moe_load" in m, "pp_bubble" in m, "step_s_median" in m) for m in run.metrics] \
        == [(False, False, False)] * 2 + [(True, True, True)]
    every = [o for rank_ops in world().allgather(ops) for o in rank_ops]
    per_step = {s: [(op, axis) for t, op, axis in every if t == s] for s in (1, 2, 3)}
    assert not [o for o in per_step[1] + per_step[2] if o[0].endswith("_obj")], per_step[1]
    assert {"allgather_obj"} <= {op for op, _ in per_step[3]}
    world_ops = {s: sum(axis == "world" for _, axis in per_step[s]) for s in (1, 2, 3)}
    assert world_ops[1] == world_ops[2] < world_ops[3], world_ops
