"""The performance model's per-call cost (``Cluster.call_overhead_s``, perf/collectives.py)
and the compute calibration's bounds (perf/calibrate.compute_rate), without MPI. The
measurement of the per-call cost itself runs under MPI: tests/mpi/test_calibrate_mpi.py."""

import dataclasses
from pathlib import Path

import pytest

from hpctrain.config import load
from hpctrain.perf import calibrate, published
from hpctrain.perf.cluster import ClusterError
from hpctrain.perf.cluster import from_dict as cluster_from_dict
from hpctrain.perf.cluster import load as load_cluster
from hpctrain.perf.collectives import buckets
from hpctrain.perf.cost import layer_flops, predict, rank_work
from hpctrain.telemetry.flops import forward_flops_per_token

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")
O = 1e-3  # seconds per call


def _with(o: float):
    return dataclasses.replace(load_cluster("dgx-a100"), call_overhead_s=o)


def _delta(overrides, part):
    cfg = load(TINY, list(overrides))
    a, b = predict(cfg, _with(0.0)), predict(cfg, _with(O))
    return a, b, b.parts[part] - a.parts[part], b.step_s - a.step_s


@pytest.mark.parametrize("sp,per_layer", [(False, 2), (True, 4)])
def test_every_tp_call_of_a_step_pays_the_overhead(sp, per_layer):
    """Per microbatch and pass: per_layer calls per layer (an all-reduce; with sequence
    parallelism an all-gather and a reduce-scatter) and the vocabulary-parallel ends (4 per
    microbatch, tests/mpi/test_calibrate_mpi.py counts them): 16 microbatches."""
    over = ["topology.tp=2", f"topology.sequence_parallel={str(sp).lower()}"]
    a, b, tp, step = _delta(over, "tp")
    L, M = 8, 16
    assert tp == pytest.approx(M * (2 * per_layer * L + 4) * O, rel=1e-9)
    assert step == pytest.approx(tp, rel=1e-9)  # pp=1: the passes are the step


def test_the_overhead_reaches_cp_ep_zero3_and_hooked_dp_but_not_blocking_dp_or_pp():
    _, _, cp, _ = _delta(["train.seq_len=32", "topology.cp=2"], "cp")
    assert cp > 0
    _, _, ep, _ = _delta(["topology.dp=2", "topology.ep=2", "model.num_experts=2",
                          "model.moe_every=2"], "ep")
    assert ep > 0
    _, _, z3, _ = _delta(["topology.dp=2", "optim.zero=3"], "zero3")
    assert z3 >= 2 * 8 * O * (1 - 1e-9)  # at least the first unit's gather, both passes
    for over in (["topology.dp=2"], ["topology.pp=2"]):
        a, b, _, step = _delta(over, "dp")
        assert step == 0 and a.parts == b.parts, over
    # reductions posted from the gradient hooks: ZeRO-2 every bucket of every microbatch
    # (8 per dp rank), overlap every bucket once
    nb = buckets([8 * e for e in rank_work(load(TINY, []))[0]["sizes"]], 0.01 * 2**20)
    for over, calls in ((["optim.zero=2"], 8 * nb), (["optim.overlap=true"], nb)):
        _, _, dp, step = _delta(["topology.dp=2", *over], "dp")
        assert dp == pytest.approx(calls * O, rel=1e-9) and step == pytest.approx(dp), over


def test_published_descriptions_have_no_call_overhead():
    """The published table is the model without it (its descriptions leave it at 0)."""
    assert {load_cluster(r.cluster).call_overhead_s for r in published.RUNS} == {0.0}


def test_a_negative_call_overhead_is_refused():
    raw = {"name": "x", "ranks_per_node": 2, "memory": "1GB", "call_overhead_s": -1,
           "peak_flops": {"float32": 1e9},
           "link": {"intra": {"latency": 0, "bandwidth": 1e9},
                    "inter": {"latency": 0, "bandwidth": 1e9}}}
    with pytest.raises(ClusterError, match=r"x.toml: call_overhead_s = -1 must be >= 0"):
        cluster_from_dict(raw, "x.toml")


@pytest.mark.parametrize("t1,t4,want", [
    (None, None, "true"),  # times of a rate below the peak: that rate, and its overheads
    (1.0, 0.5, "peak"),  # 4B faster than B (noise): the peak
    (1.0, 1.0 + 1e-9, "peak"),  # a difference too small: a rate above the peak, capped
])
def test_compute_rate_stays_between_its_bounds(monkeypatch, t1, t4, want):
    cfg = load(TINY, ["model.dtype=\"float32\""])
    m, T, peak, true, over, per_pass = cfg.model, cfg.train.seq_len, 1e9, 4e8, 1e-3, 4e-3
    f1 = T * forward_flops_per_token(m, T)
    half = m.n_layers // 2
    fh = f1 - T * sum(layer_flops(cfg, i) for i in range(half, m.n_layers))
    th = 0.6 * (t1 or 0)
    if t1 is None:  # B and 4B of the whole model, B of its first half: one stage each
        t1 = 3 * f1 / true + 3 * m.n_layers * over + 3 * per_pass
        t4 = 3 * 4 * f1 / true + 3 * m.n_layers * over + 3 * per_pass
        th = 3 * fh / true + 3 * half * over + 3 * per_pass
    times = iter([t1, t4, th, 0.01])
    monkeypatch.setattr(calibrate, "_median_time", lambda fn, repeats, stat=None: next(times))
    monkeypatch.setattr(calibrate, "measure_peak_flops", lambda dtype: peak)
    got = calibrate.compute_rate(cfg)
    assert got["peak"] == peak and got["step_overhead_s"] == 0.01
    assert got["hook_overhead_s"] == 0.0  # no one-rank group given: not measured
    if want == "true":
        assert got["rate"] == pytest.approx(true) and got["overhead_s"] == pytest.approx(over)
        assert got["pass_overhead_s"] == pytest.approx(per_pass)
    else:
        assert got["rate"] == peak and got["overhead_s"] >= 0 and got["pass_overhead_s"] >= 0


@pytest.mark.parametrize("overrides", [
    ["model.d_model=64", "model.d_ff=256", "optim.bucket_mb=0.01"],  # the calibration model
    ["model.arch=\"llama\"", "optim.bucket_mb=0.004", "topology.pp=2"],
    ["optim.bucket_mb=25"],  # one bucket
])
def test_bucket_count_is_the_reduction_buckets_cut(overrides):
    """``collectives.buckets`` over ``rank_work``'s tensor sizes: as many buckets as
    ``parallel/data.py`` cuts from the same stage's parameters."""
    from types import SimpleNamespace

    from hpctrain.model import GPTStage
    from hpctrain.parallel.data import GradBuffers
    from hpctrain.parallel.pipeline import layer_ranges
    cfg = load(TINY, overrides)
    ranges = layer_ranges(cfg)
    group = SimpleNamespace(size=1, rank=0, axis="dp")
    topo = SimpleNamespace(dpcp_comm=group, edpcp_comm=group, tp_size=1)
    for r, w in enumerate(rank_work(cfg)):
        stage = GPTStage(cfg.model, ranges[r], first=r == 0, last=r == len(ranges) - 1)
        named = list(stage.named_parameters())
        real = GradBuffers(named, topo, cfg.optim.bucket_mb)
        assert w["tensors"] == len(named)
        assert sorted(w["sizes"]) == sorted(p.numel() for _, p in named)
        ps = named[0][1].element_size()
        assert buckets([e * ps for e in w["sizes"]], cfg.optim.bucket_mb * 2**20) == \
            len(real.buckets)
