"""``plan`` prices Ulysses context parallelism (``planner/collectives.ulysses_exposed``: four
all-to-alls per layer and pass, none hidden, no ring overhead) beside the ring, and
``--search`` tries every kind for every cp > 1 (the hybrid: ``test_hybrid_cp.py``)."""

import dataclasses
from pathlib import Path

import pytest

from hpctrain.config import load
from hpctrain.planner import search
from hpctrain.planner.cluster import from_dict
from hpctrain.planner.collectives import scatter
from hpctrain.planner.cost import predict

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")
LLAMA = TINY.replace("tiny.toml", "tiny-llama.toml")
CP4 = ["train.seq_len=4096", "train.global_batch_size=4", "topology.cp=4"]


def _cluster(**over):
    raw = {"name": "test", "ranks_per_node": 4, "memory": 2 ** 40, "efficiency": 0.5,
           "peak_flops": {"float32": 1e12, "float64": 5e11},
           "link": {"intra": {"latency": 1e-6, "bandwidth": 1e10},
                    "inter": {"latency": 1e-5, "bandwidth": 1e9}}}
    return dataclasses.replace(from_dict(raw), **over)


def _cp(kind: str, cluster, *more: str) -> float:
    return predict(load(TINY, [*CP4, f"topology.cp_kind={kind}", *more]), cluster).parts["cp"]


def test_ulysses_price_is_four_all_to_alls_per_layer_and_pass():
    cfg = load(TINY, [*CP4, "topology.cp_kind=ulysses"])
    cluster = _cluster()
    m, tr = cfg.model, cfg.train
    one = tr.micro_batch_size * tr.seq_len // 4 * m.d_model * 8  # (B, T/cp, H hd) float64
    per_pass = scatter(4 * one, 4, cluster.intra) * m.n_layers  # q, k, v, o: as large
    mbs = tr.global_batch_size // tr.micro_batch_size
    assert predict(cfg, cluster).parts["cp"] == pytest.approx(2 * per_pass * mbs)


def test_ring_wins_when_its_transfers_hide_behind_long_attention():
    # T/cp = 1024 tokens: a ring step's attention outlasts its K/V hop, so the ring
    # exposes one gradient hop per layer; Ulysses' all-to-alls are never hidden.
    assert _cp("ring", _cluster()) < _cp("ulysses", _cluster())


def test_ulysses_wins_when_the_ring_pays_its_own_work():
    # ring_overhead_s (the ring's block loop and log-sum-exp merges beyond the fused
    # attention's FLOPs, as ``plan --calibrate`` measures it on CPUs) at 1 ms per layer and
    # pass: Ulysses runs one plain attention and pays only its all-to-alls.
    slow = _cluster(ring_overhead_s=1e-3)
    assert _cp("ulysses", slow) < _cp("ring", slow)
    best = [c for c in search.search(load(TINY, CP4[:2]), slow, 1, max_tp=1) if c.prediction]
    cp = [c for c in best if c.cfg.topology.cp > 1]
    assert cp and all(c.cfg.topology.cp_kind == "ulysses" for c in cp[:1])
    assert {c.cfg.topology.cp_kind for c in cp} == {"ring", "ulysses", "hybrid"}
    assert 'topology.cp_kind="ulysses"' in cp[0].sets


def test_plan_counts_ulysses_bytes():
    """``plan``'s communication line: each rank sends (cp-1)/cp of its q, k, v and output
    per layer, forward and again backward (tiny-llama: 8 query, 4 kv heads)."""
    from hpctrain.planner.memory import comm_volume

    cfg = load(LLAMA, ["topology.cp=4", "topology.cp_kind=ulysses"])
    m, tr = cfg.model, cfg.train
    row = tr.micro_batch_size * tr.seq_len // 4 * m.head_dim * 8  # one head, float64
    want = m.n_layers * 2 * (2 * m.n_heads + 2 * m.kv_heads) * row * 3 / 4
    assert comm_volume(cfg, 1000, 8, 1)["cp"] == int(want)
    ring = comm_volume(load(LLAMA, ["topology.cp=4"]), 1000, 8, 1)["cp"]
    assert ring > want  # the ring passes k, v around cp-1 hops twice and returns gradients
