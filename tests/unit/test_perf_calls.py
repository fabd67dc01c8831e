"""The performance model's per-call cost (``Cluster.call_overhead_s``, planner/collectives.py)
and the compute calibration's fit (planner/compute.fit_compute), without MPI. The
measurement of the per-call cost itself runs under MPI: tests/mpi/test_calibrate_mpi.py."""

import dataclasses
from pathlib import Path

import pytest

from hpctrain.config import load
from hpctrain.planner import compute, published
from hpctrain.planner.cluster import ClusterError
from hpctrain.planner.cluster import from_dict as cluster_from_dict
from hpctrain.planner.cluster import load as load_cluster
from hpctrain.planner.collectives import buckets
from hpctrain.planner.cost import layer_flops, predict, rank_work
from hpctrain.planner.flops import forward_flops_per_token

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


def test_the_overhead_reaches_cp_ep_zero3_but_not_dp_or_pp():
    _, _, cp, _ = _delta(["train.seq_len=32", "topology.cp=2"], "cp")
    assert cp > 0
    _, _, ep, _ = _delta(["topology.dp=2", "topology.ep=2", "model.num_experts=2",
                          "model.moe_every=2"], "ep")
    assert ep > 0
    _, _, z3, _ = _delta(["topology.dp=2", "optim.zero=3"], "zero3")
    assert z3 >= 2 * 8 * O * (1 - 1e-9)  # at least the first unit's gather, both passes
    for over in (["topology.dp=2"], ["topology.pp=2"], ["topology.dp=2", "optim.zero=2"],
                 ["topology.dp=2", "optim.overlap=true"]):
        a, b, _, step = _delta(over, "dp")
        assert step == 0 and a.parts == b.parts, over


def test_every_reduction_a_hook_posts_pays_the_post_overhead():
    """ZeRO-2 posts every bucket of every microbatch (8 per dp rank), overlap every bucket
    once; a blocking dp reduction and a single rank post none."""
    nb = buckets([8 * e for e in rank_work(load(TINY, []))[0]["sizes"]], 0.01 * 2**20)
    base = load_cluster("dgx-a100")
    posted = dataclasses.replace(base, post_overhead_s=O)
    for over, calls in ((["topology.dp=2", "optim.zero=2"], 8 * nb),
                        (["topology.dp=2", "optim.overlap=true"], nb),
                        (["topology.dp=2"], 0), (["optim.zero=2"], 0)):
        cfg = load(TINY, over)
        a, b = predict(cfg, base), predict(cfg, posted)
        assert b.parts["dp"] - a.parts["dp"] == pytest.approx(calls * O, rel=1e-9), over
        assert b.step_s - a.step_s == pytest.approx(calls * O, rel=1e-9), over


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


def _grid(cfg, rate, over, per_pass, noise=None):
    """Times of compute.grid's points for a machine of that rate and overheads."""
    m, T, L = cfg.model, cfg.train.seq_len, cfg.model.n_layers
    whole = forward_flops_per_token(m, T)
    out = {}
    for n, b in compute.grid(cfg):
        f = b * T * (whole - sum(layer_flops(cfg, i) for i in range(n, L)))
        out[(n, b)] = 3 * f / rate + 3 * n * over + 3 * per_pass
        out[(n, b)] *= 1 + (noise(n, b) if noise else 0)
    return out


def test_the_compute_grid_spans_depths_and_microbatches():
    cfg = load(TINY, ["model.n_layers=8", "train.micro_batch_size=2"])
    assert compute.grid(cfg) == [(n, b) for n in (8, 4, 2) for b in (2, 4, 8)]
    one = load(TINY, ["model.n_layers=1"])
    assert {n for n, _ in compute.grid(one)} == {1}


@pytest.mark.parametrize("layers", [8, 3])
def test_fit_compute_recovers_the_machine_that_made_the_times(layers):
    cfg = load(TINY, ["model.dtype=\"float32\"", f"model.n_layers={layers}"])
    rate, over, per_pass = compute.fit_compute(cfg, _grid(cfg, 4e8, 1e-3, 4e-3), 1e9)
    assert rate == pytest.approx(4e8, rel=1e-6)
    assert over == pytest.approx(1e-3, rel=1e-6) and per_pass == pytest.approx(4e-3, rel=1e-6)


def test_fit_compute_keeps_its_bounds_on_noisy_times():
    """A rate above the peak is noise: the peak, the rest in the overheads; times that fall
    as the work grows give no negative term; one depth puts everything per layer."""
    cfg = load(TINY, ["model.dtype=\"float32\""])
    rate, over, per_pass = compute.fit_compute(cfg, _grid(cfg, 4e9, 1e-3, 0.0), 1e9)
    assert rate == 1e9 and over > 0 and per_pass >= 0
    falling = {p: 1.0 / (p[0] * p[1]) for p in compute.grid(cfg)}
    rate, over, per_pass = compute.fit_compute(cfg, falling, 1e9)
    assert 0 < rate <= 1e9 and over >= 0 and per_pass >= 0
    one = load(TINY, ["model.dtype=\"float32\"", "model.n_layers=1"])
    rate, over, per_pass = compute.fit_compute(one, _grid(one, 4e8, 1e-3, 4e-3), 1e9)
    assert rate == pytest.approx(4e8, rel=1e-6)
    assert over == pytest.approx(5e-3, rel=1e-6) and per_pass == 0.0


def test_fit_compute_is_near_the_truth_under_a_few_percent_of_noise():
    cfg = load(TINY, ["model.dtype=\"float32\""])
    wobble = lambda n, b: 0.03 * (-1) ** (n + b)  # noqa: E731
    rate, over, per_pass = compute.fit_compute(cfg, _grid(cfg, 4e8, 1e-3, 4e-3, wobble), 1e9)
    assert rate == pytest.approx(4e8, rel=0.25) and over == pytest.approx(1e-3, rel=0.15)


def test_compute_rate_reads_the_grid_it_measured(monkeypatch):
    cfg = load(TINY, ["model.dtype=\"float32\""])
    times = _grid(cfg, 4e8, 1e-3, 4e-3)
    monkeypatch.setattr(compute, "grid_times", lambda cfg, repeats: times)
    monkeypatch.setattr(compute, "measure_peak_flops", lambda dtype: 1e9)
    monkeypatch.setattr(compute, "_median_time", lambda fn, repeats, stat=None: 0.01)
    got = compute.compute_rate(cfg)
    assert got["peak"] == 1e9 and got["rate"] == pytest.approx(4e8)
    assert got["overhead_s"] == pytest.approx(1e-3) and got["step_overhead_s"] == 0.01
    assert got["hook_overhead_s"] == 0.0  # no one-rank group given: not measured


def test_trimmed_mean_drops_the_tails():
    assert compute.trimmed_mean([1.0] * 9 + [100.0]) == 1.0
    assert compute.trimmed_mean([1.0, 2.0, 3.0]) == 2.0  # too few to cut: the mean


@pytest.mark.parametrize("overrides", [
    ["model.d_model=64", "model.d_ff=256", "optim.bucket_mb=0.01"],  # the calibration model
    ["model.arch=\"llama\"", "optim.bucket_mb=0.004", "topology.pp=2"],
    ["optim.bucket_mb=25"],  # one bucket
])
def test_bucket_count_is_the_reduction_buckets_cut(overrides):
    """``collectives.buckets`` over ``rank_work``'s tensor sizes: as many buckets as
    ``parallel/grad_sync/interface.py`` cuts from the same stage's parameters."""
    from fakes import fake_topology

    from hpctrain.model import DecoderStage
    from hpctrain.parallel import grad_sync
    from hpctrain.pipeline.schedules import layer_ranges
    cfg = load(TINY, overrides)
    ranges = layer_ranges(cfg)
    topo = fake_topology()
    for r, w in enumerate(rank_work(cfg)):
        stage = DecoderStage(cfg.model, ranges[r], first=r == 0, last=r == len(ranges) - 1)
        named = list(stage.named_parameters())
        real = grad_sync.create(named, topo, cfg.optim.bucket_mb)
        assert w["tensors"] == len(named)
        assert sorted(w["sizes"]) == sorted(p.numel() for _, p in named)
        ps = named[0][1].element_size()
        assert buckets([e * ps for e in w["sizes"]], cfg.optim.bucket_mb * 2**20) == \
            len(real.buckets)
