"""Invariant 1 for pipeline parallelism, in one launch: every schedule at pp=2 and
pp=4, and pp composed with dp and tp, trains the same model as one rank (losses, grad norms,
final parameters in global shape; float64, relative error <= 1e-9)."""

import pytest
from inprocess import baseline, train_layout
from launch import TINY, assert_same

from hpctrain.config import load, microbatches
from hpctrain.pipeline.schedules import from_config
from hpctrain.pipeline.simulate import simulate

SP = "topology.sequence_parallel=true"


def kind(k: str) -> str:
    return f'schedule.kind="{k}"'


# (name, ranks, overrides). tiny.toml: 8 layers, 16 sequences of 1 -> 16 microbatches per
# dp rank; interleaved and zbv at pp=4 with 2 virtual stages use all 8 layers (one per chunk).
# Every schedule at pp=4; at pp=2 the ones no other test runs there (1f1b with uneven
# boundaries below, interleaved in test_eval_lineage.py, zb-h1 composed with dp below).
SCHEDULES = [
    (f"{k}-pp{pp}", pp, [f"topology.pp={pp}", kind(k)]
     + (["schedule.virtual_stages=2"] if k == "interleaved" else []))
    for pp, kinds in ((2, ("gpipe",)), (4, ("gpipe", "1f1b", "interleaved", "zb-h1")))
    for k in kinds
] + [("1f1b-pp2-boundaries", 2, ["topology.pp=2", 'schedule.boundaries="3"']),  # 3 + 5 layers
     # ZB-V: 2 chunks per rank in a V (pp rank 3 holds the two middle stages and hands the
     # tensors between them over in memory), 16 microbatches >= 2pp-1 (steady state)
     ("zbv-pp4", 4, ["topology.pp=4", kind("zbv")])]
COMPOSED = [
    ("dp2xpp2-zb", 4, ["topology.dp=2", "topology.pp=2", kind("zb-h1")]),
    ("tp2xpp2", 4, ["topology.tp=2", "topology.pp=2", kind("1f1b")]),
    # selective recompute: the attention core replayed in backward, under tp and pp
    ("tp2xpp2-selective", 4, ["topology.tp=2", "topology.pp=2", kind("zb-h1"),
                              'model.recompute="selective"']),
    ("tp2xpp2-sp-interleaved", 4, ["topology.tp=2", "topology.pp=2", SP, kind("interleaved"),
                                   "schedule.virtual_stages=2"]),
    ("dp2xtp2xpp2-sp", 8, ["topology.dp=2", "topology.tp=2", "topology.pp=2", SP,
                           kind("1f1b")]),
]


def _check(tmp_path, session_dir, name, n, overrides):
    ref = baseline(session_dir)
    run = train_layout(tmp_path / name, n, *overrides)
    assert_same(run, ref, rel=1e-9, what=name)
    # The pipeline leaves its evidence: transfers on the pp axis, the bubble next to the
    # simulator's (values are timings: only their presence and range are checked).
    # Only in-flight microbatches keep activations: the runner's peak equals the simulator's
    # (1F1B: pp - rank on pp rank `rank`).
    cfg = load(TINY, overrides)
    peak = simulate(from_config(cfg, microbatches(cfg))).peak_inflight
    for m in run.metrics:
        assert m["comm_bytes"].get("pp", 0) > 0, m
        assert 0.0 <= m["pp_bubble_sim"] < 1.0 and 0.0 <= m["pp_bubble"] < 1.0, m
        assert m["pp_peak_inflight"] == peak, (m["pp_peak_inflight"], peak)


@pytest.mark.parametrize("name,n,overrides", SCHEDULES, ids=[c[0] for c in SCHEDULES])
def test_schedule_float64_equals_one_rank(tmp_path, session_dir, name, n, overrides):
    _check(tmp_path, session_dir, name, n, overrides)


@pytest.mark.parametrize("name,n,overrides", COMPOSED, ids=[c[0] for c in COMPOSED])
def test_pp_composed_float64_equals_one_rank(tmp_path, session_dir, name, n, overrides):
    _check(tmp_path, session_dir, name, n, overrides)
