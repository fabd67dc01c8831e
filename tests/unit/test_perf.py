"""The performance model (hpctrain/planner/, docs/planning.md), without MPI: published
runs within 20 %, the stored calibration runs of this machine within 25 %, the search's
choices and rejection reasons, cluster files, and the pieces (FLOPs, placement, collectives).
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.__main__ import main
from hpctrain.config import TopologyConfig, from_dict, load, microbatches
from hpctrain.planner import published, search
from hpctrain.planner.cluster import ClusterError, dumps, shipped
from hpctrain.planner.cluster import from_dict as cluster_from_dict
from hpctrain.planner.cluster import load as load_cluster
from hpctrain.planner.cost import (
    Extras,
    Link,
    allreduce,
    core_redo_flops,
    equivalent,
    layer_flops,
    packed_crossing,
    predict,
    scatter,
)
from hpctrain.planner.flops import forward_flops_per_token
from hpctrain.planner.memory import estimate
from hpctrain.topology import crossing

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "share/configs/tiny.toml")
CALIBRATION = ROOT / "share/perf/calibration-runs.json"


# -- published runs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def table():
    return published.table()


def test_published_runs_within_20_percent(table):
    held = [r for r in table if r["run"].held]
    assert len(held) >= 6 and len({r["run"].source for r in held}) >= 2
    bad = [(r["run"].name, r["run"].layout, f"{100 * r['error']:+.1f}%") for r in held
           if abs(r["error"]) > 0.20]
    assert not bad, bad


def test_runs_outside_the_tolerance_say_why(table):
    for r in table:
        assert r["run"].held or r["run"].note, r["run"].name
        assert r["run"].source and r["run"].published


def test_one_fitted_efficiency_constant():
    """Every public description of one accelerator carries the same achievable fraction of
    peak: one for the NVIDIA GPUs, one fitted to the Frontier runs for the MI250X GCD."""
    nvidia = {load_cluster(r.cluster).efficiency for r in published.RUNS
              if r.cluster != "frontier-mi250x"}
    assert len(nvidia) == 1


def test_published_models_have_their_parameter_counts():
    """GQA + SwiGLU folded into the MLP width keeps parameters (and FLOPs) exact."""
    for run, billions in ((published.RUNS[10], 8.03), (published.RUNS[11], 70.55),
                          (published.RUNS[0], 1.7)):
        cfg = equivalent(published.config_of(run), run.extras)
        m = cfg.model
        n = m.n_layers * (4 * m.d_model ** 2 + 2 * m.d_model * m.ffn_dim)
        n += m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
        assert abs(n / 1e9 - billions) / billions < 0.04, (run.name, n)


# -- calibration runs on this machine ------------------------------------------------------
CAL = json.loads(CALIBRATION.read_text())
# Rows the model misses by more than 25 % (docs/results.md says why): strict, so
# that a model or a measurement that brings them inside the tolerance turns these red.
MISSED = {  # the run of 2026-12-05 13:20 UTC (medians of 5 rounds; min-max in the docs)
    "tp=2 sp": "+27 %: measured 0.171 s (rounds 0.166-0.178), predicted 0.217 s; the "
               "model charges 4 ring all-gathers / reduce-scatters a layer at the calibrated "
               "link rate (+17 % on 2026-12-01, before large ones were posted)",
}


def test_calibration_table_is_dated_and_covers_both_machines():
    assert CAL["date"] and CAL["uptime"]
    assert len({r["layout"] for r in CAL["rows"]}) >= 5
    assert {r["cluster"] for r in CAL["rows"]} == {"this-machine.toml",
                                                   "this-machine-2node.toml"}
    assert all(r["load_average"] for r in CAL["rows"])


@pytest.mark.parametrize("row", [
    pytest.param(r, id=r["layout"], marks=[pytest.mark.xfail(strict=True,
                                                           reason=MISSED[r["layout"]])]
                 if r["layout"] in MISSED else [])
    for r in CAL["rows"]])
def test_calibration_run_within_25_percent(row):
    cfg = load(str(ROOT / CAL["config"]), [*CAL["model"], *row["overrides"]])
    p = predict(cfg, load_cluster(str(ROOT / "share/clusters" / row["cluster"])))
    got = p.step_s - p.parts["checkpoint"]  # the runs save no checkpoint
    assert got == pytest.approx(row["predicted_s"], rel=1e-9)  # the table is this model's
    assert abs(got / row["measured_s"] - 1) <= 0.25, (got, row["measured_s"])


# -- pieces --------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [(), ("model.num_experts=4", "model.top_k=2",
                                            "model.moe_every=2")])
def test_layer_flops_add_up_to_telemetry_flops(overrides):
    cfg = load(TINY, list(overrides))
    m, T = cfg.model, cfg.train.seq_len
    total = sum(layer_flops(cfg, i) for i in range(m.n_layers)) + 2 * m.d_model * m.vocab_size
    assert total == pytest.approx(forward_flops_per_token(m, T), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4),
       st.integers(1, 8), st.integers(1, 2))
def test_packed_crossing_is_topology_crossing(pp, dpo, ep, tp, rpn, cp):
    world = pp * dpo * ep * tp * cp
    rpn = min(rpn, world)
    if world % rpn:
        return
    t = TopologyConfig(dp=dpo * ep, tp=tp, pp=pp, ep=ep, cp=cp)
    want = {a: n > 0 for a, (n, _) in crossing(t, world // rpn, rpn).items()}
    assert packed_crossing((pp, dpo, ep, cp, tp), rpn) == want


def test_collective_formulas():
    fast, slow = Link(1e-6, 100e9), Link(1e-5, 1e9)
    n = 1e8
    assert allreduce(n, 1, slow) == 0 and scatter(n, 1, slow) == 0
    assert allreduce(n, 4, slow) == pytest.approx(6e-5 + 1.5 * n / 1e9)
    assert scatter(n, 4, slow) == pytest.approx(3e-5 + 0.75 * n / 1e9)
    assert allreduce(n, 8, slow, "tree") == pytest.approx(6e-5 + 2 * n / 1e9)
    # 4 nodes x 8 ranks: only 1/8 of the bytes cross the slow link
    flat, hier = allreduce(n, 32, slow), allreduce(n, 32, slow, "hierarchical", 8, fast)
    assert hier < flat / 4


def test_prediction_parts_add_up_and_axes_use_their_links():
    cfg = load(TINY, ["topology.dp=2", "topology.tp=2", "topology.pp=2"])
    cluster = dataclasses.replace(load_cluster("dgx-a100"), ranks_per_node=4)
    p = predict(cfg, cluster)
    assert p.step_s == pytest.approx(sum(p.parts.values()))
    assert p.links["tp"] == "intra" and p.links["pp"] == "inter"
    assert all(v >= 0 for v in p.parts.values()) and 0 <= p.bubble < 1


def test_more_bandwidth_never_slower():
    cfg = load(TINY, ["topology.dp=4", "topology.tp=2"])
    c = load_cluster("dgx-a100")
    faster = dataclasses.replace(c, inter=Link(c.inter.latency, 10 * c.inter.bandwidth))
    c, faster = (dataclasses.replace(x, ranks_per_node=2) for x in (c, faster))
    assert predict(cfg, faster).step_s < predict(cfg, c).step_s


def test_selective_recompute_priced_by_its_attention_core():
    """Selective recompute adds the attention core's forward (QK^T and AV) to the backward:
    between no recompute and full recompute, and it grows with the sequence."""
    cluster = _small_cluster(2 ** 40)

    def compute(rc, *sets):
        cfg = load(TINY, ["topology.tp=2", f'model.recompute="{rc}"', *sets])
        return predict(cfg, cluster).parts["compute"]

    none, sel, full = (compute(rc) for rc in ("none", "selective", "full"))
    assert none < sel < full
    cfg = load(TINY, ["topology.tp=2", 'model.recompute="selective"'])
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    rate = cluster.peak("float64") * cluster.efficiency * cluster.compute_share
    redo = core_redo_flops(cfg) * cfg.model.n_layers * tokens / rate * microbatches(cfg)
    assert sel - none == pytest.approx(redo)
    long = [compute(rc, "train.seq_len=1024") for rc in ("none", "selective")]
    assert long[1] - long[0] > 30 * (sel - none)  # quadratic: x64 tokens x ~64 keys each
    # --search tries selective where the layout does not fit without recompute
    def modes(memory):
        return {c.label().rsplit(" ", 1)[1] for c in search.search(cfg, _small_cluster(memory), 1)
                if c.cfg.topology.tp == 4 and c.cfg.train.micro_batch_size == 8}

    assert modes(2 ** 40) == {"recompute=off", "recompute=on"}
    at = load(TINY, ["topology.tp=4", "train.micro_batch_size=8"])
    tight = estimate(at).total - 1  # selective fits where none does not
    assert estimate(dataclasses.replace(at, model=dataclasses.replace(
        at.model, recompute="selective"))).total <= tight
    assert modes(tight) == {"recompute=off", "recompute=selective", "recompute=on"}


# -- search --------------------------------------------------------------------------------
def _small_cluster(memory: int):
    raw = {"name": "test", "ranks_per_node": 4, "memory": memory, "efficiency": 0.5,
           "peak_flops": {"float32": 1e12, "float64": 5e11},
           "link": {"intra": {"latency": 1e-6, "bandwidth": 1e10},
                    "inter": {"latency": 1e-5, "bandwidth": 1e9}}}
    return cluster_from_dict(raw)


def test_a_model_that_only_fits_with_pp_gets_pp():
    cfg = load(TINY, ["model.n_heads=1", "model.d_ff=4096", "train.global_batch_size=8"])
    roomy = search.search(cfg, _small_cluster(2 ** 40), 1)
    flat = [c for c in roomy if c.prediction and c.cfg.topology.pp == 1]
    limit = min(c.prediction.memory.total for c in flat) - 1
    cands = search.search(cfg, _small_cluster(limit), 1)
    fits = [c for c in cands if c.prediction]
    assert fits and all(c.cfg.topology.pp > 1 for c in fits)
    assert fits[0].cfg.topology.pp > 1
    for c in cands:
        if c.cfg.topology.pp == 1 and not c.prediction and c.reason.startswith("needs"):
            assert "per rank, test has" in c.reason
    assert any(c.cfg.topology.pp == 1 and c.reason.startswith("needs") for c in cands)


def test_rejection_reasons_name_the_rule():
    cfg = load(TINY, ["train.global_batch_size=8"])
    cands = search.search(cfg, _small_cluster(2 ** 40), 2)
    reasons = {c.label(): c.reason for c in cands if not c.prediction}
    assert reasons["dp=8 tp=1 pp=1 ep=1 cp=1 - mbs=2 zero=0 recompute=off"] == (
        "global batch 8 does not split into dp=8 x micro_batch_size=2")
    key = "dp=1 tp=1 pp=8 ep=1 cp=1 interleaved v=2 mbs=1 zero=0 recompute=off"
    assert "n_layers=8 < pp*virtual_stages = 8*2" in reasons[key]
    key = "dp=2 tp=1 pp=4 ep=1 cp=1 interleaved v=2 mbs=2 zero=0 recompute=off"
    assert "there are 2 microbatches" in reasons[key]
    ranked = [c.prediction.step_s for c in cands if c.prediction]
    assert ranked == sorted(ranked[:30]) + ranked[30:]


@pytest.mark.slow(reason="searches every layout of 1536 GPUs (a published Megatron run)")
def test_search_recommends_what_megatron_used():
    """GPT 145.6B on 192 DGX A100 nodes: Narayanan et al. used tp=8 (one node), pp=8, dp=24.
    The search keeps a node's 8 GPUs in one model-parallel group (tp, or tp x cp, a split
    the 2021 code did not have) and ranks the authors' split among the first three, within
    2 % of the best (pp=12, dp=16: fewer gradient bytes per rank to reduce over dp). Layouts
    are ranked by their best schedule (one layout appears once per schedule and ZeRO
    stage); the first three among those without HSDP (sharding within a node, which the
    2021 code did not have either and which moves layouts with several dp ranks per node
    ahead), the 2 % against the best of all."""
    run = published.RUNS[6]
    cands = search.search(published.config_of(run), load_cluster(run.cluster), 192,
                          max_tp=8, cp_kinds=("ring",))  # no Ulysses in the 2021 code
    top = cands[0].cfg.topology
    assert top.tp * top.cp == run.layout["tp"]
    best: dict = {}  # (tp, pp, dp) -> its best candidate, in rank order
    for c in cands:
        t = c.cfg.topology
        if not t.shard_within:
            best.setdefault((t.tp, t.pp, t.dp), c)
    assert (8, 8, 24) in list(best)[:3]
    assert best[(8, 8, 24)].prediction.step_s < 1.02 * cands[0].prediction.step_s


@pytest.mark.slow(reason="a full search of a published 512-GPU Megatron run")
def test_search_explains_a_faster_layout_than_megatrons():
    """GPT 39.1B on 64 nodes: the authors' tp=8 pp=2 is predicted within 10 % of the best,
    tp=4 with a longer pipeline (pp 4 or 8, interleaved): half the tp all-reduce bytes and
    about as many parameters (gradient bytes over dp) per rank, the longer pipeline's bubble hidden
    by its virtual stages. That explanation is of the best layout without HSDP (which the
    authors' code did not have either); the 10 % is against the best of all."""
    run = published.RUNS[4]
    cands = search.search(published.config_of(run), load_cluster(run.cluster), 64,
                          max_tp=8, cp_kinds=("ring",))  # no Ulysses in the authors' code
    theirs = next(c for c in cands if c.prediction and
                  (c.cfg.topology.tp, c.cfg.topology.pp) == (8, 2))
    flat = next(c for c in cands if c.prediction and not c.cfg.topology.shard_within)
    best = flat.prediction
    assert flat.cfg.topology.tp == 4 and flat.cfg.topology.pp in (4, 8)
    assert flat.cfg.schedule.kind == "interleaved"
    assert best.parts["tp"] < theirs.prediction.parts["tp"]
    # about the gradient bytes over dp per rank (the seconds exposed differ: each hides
    # behind its own last backward, overlap_across_nodes)
    assert best.memory.params <= 1.05 * theirs.prediction.memory.params
    assert best.step_s < theirs.prediction.step_s < 1.10 * cands[0].prediction.step_s


def test_best_layout_as_set_arguments_and_slurm_line():
    cfg = load(TINY)
    c = search.search(cfg, _small_cluster(2 ** 40), 2)[0]
    again = load(TINY, c.sets)
    assert again.topology == c.cfg.topology and again.schedule.kind == c.cfg.schedule.kind
    line = search.slurm_line(c, 2, _small_cluster(2 ** 40), TINY)
    assert "--nodes=2 --ntasks-per-node=4" in line and "jobs/multi-node.sbatch" in line


# -- cluster files and the command line ----------------------------------------------------
def test_shipped_descriptions_load_and_round_trip():
    assert {"dgx-a100", "dgx-h100", "cpu-epyc-7763", "this-machine"} <= set(shipped())
    for name in shipped():
        c = load_cluster(name)
        assert cluster_from_dict(__import__("tomllib").loads(dumps(c))) == \
            dataclasses.replace(c, name=c.name)


@pytest.mark.parametrize("change,words", [
    ({"collective": "star"}, "collective = 'star'; valid: ring, tree, hierarchical"),
    ({"ranks_per_node": 0}, "ranks_per_node = 0 must be an integer >= 1"),
    ({"efficiency": 1.5}, "efficiency = 1.5 must be > 0 and <= 1"),
    ({"memory": "lots"}, "memory = 'lots' must be bytes > 0"),
    ({"peak_flops": {"int8": 1.0}}, "peak_flops.int8: unknown dtype"),
    ({"link": {"intra": {"latency": 0, "bandwidth": -1}}}, "bandwidth = -1 must be > 0"),
    ({"link": {"intra": {"latency": 0, "bandwidth": 1e9},
               "inter": {"latency": 0, "bandwidth": 1e9, "ports": 0.5}}},
     "[link.inter]: ports = 0.5 must be 0 (one per rank) or a number >= 1"),
])
def test_bad_cluster_files_name_key_value_and_rule(change, words):
    raw = {"name": "x", "ranks_per_node": 2, "memory": "1GB",
           "peak_flops": {"float32": 1e9},
           "link": {"intra": {"latency": 0, "bandwidth": 1e9},
                    "inter": {"latency": 0, "bandwidth": 1e9}}}
    with pytest.raises(ClusterError, match=None) as e:
        cluster_from_dict({**raw, **change}, "x.toml")
    assert words in str(e.value) and "x.toml" in str(e.value)


def test_plan_cli_prints_the_prediction(capsys):
    assert main(["plan", TINY, "--world-size", "2", "--set", "topology.dp=2",
                 "--cluster", "dgx-a100"]) == 0
    out = capsys.readouterr().out
    assert "performance on dgx-a100" in out and "tokens/s" in out and "MFU" in out


@pytest.mark.parametrize("args,words", [
    (["--cluster", "nowhere", "--world-size", "1"], "cluster 'nowhere': no such file"),
    (["--search", "--world-size", "1"], "--search needs --cluster and --nodes"),
])
def test_plan_cli_refuses_with_one_line(capsys, args, words):
    assert main(["plan", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_plan_search_cli(capsys):
    assert main(["plan", TINY, "--search", "--cluster", "dgx-a100", "--nodes", "2",
                 "--ranks-per-node", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best as --set arguments" in out and "sbatch --nodes=2 --ntasks-per-node=4" in out
    assert "rejected" in out


def test_memory_in_a_prediction_is_the_plans_estimate():
    cfg = from_dict({"topology": {"dp": 2}, "train": {"global_batch_size": 8}})
    assert predict(cfg, load_cluster("dgx-a100")).memory == estimate(cfg)
    assert Extras() == Extras(0, False, False, False)


LONG = ["train.seq_len=4096", "train.global_batch_size=4"]


def test_plan_search_lists_what_fits_a_memory_per_rank(capsys, tmp_path):
    """A long sequence on 4 ranks with less memory than any cp = 1, zero < 3 layout needs:
    only context-parallel or ZeRO-3 layouts are listed, each with its --set line."""
    cfg = load(TINY, LONG)
    roomy = search.search(cfg, _small_cluster(2 ** 40), 1)
    plain = [c for c in roomy if c.prediction and c.cfg.topology.cp == 1
             and c.cfg.optim.zero != 3]
    limit = min(c.prediction.memory.total for c in plain) - 1
    path = tmp_path / "test.toml"
    path.write_text(dumps(_small_cluster(2 ** 40)))
    args = ["plan", TINY, "--search", "--cluster", str(path), "--nodes", "1", "--top", "100",
            "--memory-per-rank", str(limit), *[x for s in LONG for x in ("--set", s)]]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    fits = [i for i, x in enumerate(out) if re.match(r"\s+\d+\. ", x)]  # "  1. dp=..."
    assert fits and "does not fit in memory" in "\n".join(out)
    for i in fits:
        assert " cp=1 " not in out[i] or " zero=3 " in out[i], out[i]
        sets = out[i + 1].split()
        assert sets[0] == "--set" and ("topology.cp=2" in sets or "topology.cp=4" in sets
                                       or "optim.zero=3" in sets), out[i + 1]
    assert any("topology.cp=" in out[i + 1] for i in fits)


def test_search_models_cp_zero3_zbv_and_keeps_refusals():
    """cp, ZeRO-3 and zbv are enumerated and priced (ring and gathers exposed >= 0); the
    combinations validate refuses are rejected with its message."""
    cfg = load(TINY, [*LONG, "model.num_experts=2", "model.capacity_factor=1.25",
                      "model.moe_every=2"])
    cands = search.search(cfg, _small_cluster(2 ** 40), 1)
    fits = [c for c in cands if c.prediction]
    kinds = {(c.cfg.topology.cp > 1, c.cfg.optim.zero, c.cfg.schedule.kind) for c in fits}
    assert any(z == 3 for _, z, _ in kinds) and any(k == "zbv" for _, _, k in kinds)
    assert not any(cp for cp, _, _ in kinds)  # cp needs capacity_factor = 0
    reasons = [c.reason for c in cands if not c.prediction]
    assert any("capacity_factor=1.25 needs topology.cp=1" in r for r in reasons)
    assert (False, 3, "zbv") in kinds  # ZeRO-3 runs the split backward of zbv
    assert any("optim.zero=3 cannot be combined with model.recompute" in r for r in reasons)
    cfg = load(TINY, LONG)
    for o in (["topology.cp=4"], ["topology.cp=2", "topology.dp=2", "optim.zero=3"]):
        p = predict(load(TINY, [*LONG, *o]), _small_cluster(2 ** 40))
        assert p.parts["cp"] > 0 and p.world == 4 and p.parts["zero3"] >= 0
        assert p.step_s == pytest.approx(sum(p.parts.values()))
    one = predict(cfg, _small_cluster(2 ** 40))
    four = predict(load(TINY, [*LONG, "topology.cp=4"]), _small_cluster(2 ** 40))
    assert four.parts["compute"] == pytest.approx(one.parts["compute"] / 4)
