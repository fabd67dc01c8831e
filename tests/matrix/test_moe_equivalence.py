"""Invariant 1 for mixture-of-experts models in one launch (5 steps, float64).

The one-rank reference uses ``micro_batch_size = dp * mbs``: its microbatch j is then the
global microbatch j of the parallel run (the same tokens in the same order), over which the
load-balancing statistics and the capacity are defined (see hpctrain/model/moe.py).
"""

import math

import numpy as np
import pytest
import torch
from inprocess import baseline, train_layout
from launch import TINY, assert_same

from hpctrain.config import load
from hpctrain.data.dataset import Sampler, load_tokens
from hpctrain.model.moe import LocalExchange, MoE
from hpctrain.model.stage import DTYPES, DecoderStage, LocalOps, init_parameters

MOE = ("model.num_experts=4", "model.moe_every=2")  # experts in blocks 1, 3, 5, 7
K2 = ("model.top_k=2",)


def ref(session_dir, global_mb: int, *extra):
    return baseline(session_dir, *MOE, f"train.micro_batch_size={global_mb}", *extra)


def check_moe_metrics(run, ref_run):
    """Same per-expert loads and drops as one rank, every step."""
    for a, b in zip(run.metrics, ref_run.metrics):
        assert a["moe_load"] == b["moe_load"], (a["moe_load"], b["moe_load"])
        assert a["moe_dropped"] == b["moe_dropped"]
        assert math.isclose(a["moe_aux_loss"], b["moe_aux_loss"], rel_tol=1e-9)
        assert math.isclose(a["moe_z_loss"], b["moe_z_loss"], rel_tol=1e-9)


OVERLAP = "schedule.moe_overlap=true"  # all-to-alls as D/C schedule actions (phase 2)


@pytest.mark.parametrize("n,layout,k", [
    (2, ("topology.dp=2", "topology.ep=2", OVERLAP), ()),
    (4, ("topology.dp=4", "topology.ep=4"), K2),
    # dp=4 x ep=2 runs in test_zero.py (ZeRO-2, against this file's baseline)
    (4, ("topology.dp=2", "topology.ep=2", "topology.tp=2"), K2),
])
def test_ep_dropless_equals_one_rank(tmp_path, session_dir, n, layout, k):
    dp = int(layout[0].split("=")[1])
    reference = ref(session_dir, dp, *k)
    run = train_layout(tmp_path / "run", n, *MOE, *layout, *k)
    assert_same(run, reference, rel=1e-9, what=" ".join(layout))
    check_moe_metrics(run, reference)
    assert run.metrics[0]["moe_dropped_total"] == 0
    assert run.losses[-1] < run.losses[0]
    m = run.metrics[-1]
    assert m["moe_a2a_s"] > 0 and m["moe_a2a_s"] >= m["moe_a2a_exposed_s"] >= 0


@pytest.mark.parametrize("n,layout", [
    (4, ("topology.dp=2", "topology.ep=2", "topology.pp=2", "schedule.kind=\"1f1b\"", OVERLAP)),
    (8, ("topology.dp=2", "topology.ep=2", "topology.pp=2", "topology.tp=2")),
])
def test_ep_with_pipeline_equals_one_rank(tmp_path, session_dir, n, layout):
    reference = ref(session_dir, 2)
    run = train_layout(tmp_path / "run", n, *MOE, *layout)
    assert_same(run, reference, rel=1e-9, what=" ".join(layout))
    check_moe_metrics(run, reference)


def test_capacity_that_drops_nothing_equals_dropless(tmp_path, session_dir):
    reference = ref(session_dir, 2)
    run = train_layout(tmp_path / "run", 2, *MOE, "topology.dp=2", "topology.ep=2",
                    "model.capacity_factor=4.0")
    assert all(m["moe_dropped_total"] == 0 for m in run.metrics)
    assert_same(run, reference, rel=1e-9, what="capacity 4.0")


def independent_drop_count(overrides, global_mb: int) -> dict:
    """Step 1's dropped assignments per layer and expert, recounted here by a plain loop
    over tokens on a one-process model at its initial parameters."""
    cfg = load(TINY, list(overrides))
    m, t = cfg.model, cfg.train
    resid = m.init_std / math.sqrt(2 * m.n_layers)
    ex = LocalExchange()
    stage = DecoderStage(m, range(m.n_layers), True, True, ffn_factory=lambda i: MoE(
        m, LocalOps(), ex, DTYPES[m.dtype], resid) if m.moe_layer(i) else None)
    init_parameters([stage], t.seed)
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, global_mb, 1, 0, t.seed)
    dropped = {}
    inputs = {}
    for i, block in stage.blocks.items():
        if isinstance(block.mlp, MoE):
            dropped[i] = [0] * m.num_experts
            block.mlp.register_forward_pre_hook(
                lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
    with torch.no_grad():
        for x, y in sampler.local(0):
            stage(x, y)
            for i, h in inputs.items():
                router = stage.blocks[i].mlp.router
                probs = torch.softmax(h.reshape(-1, m.d_model) @ router.T, -1)
                choice = probs.topk(m.top_k, -1).indices.tolist()  # [[e1, e2], ...]
                cap = math.ceil(m.capacity_factor * len(choice) * m.top_k / m.num_experts)
                used = [0] * m.num_experts
                for slot in range(m.top_k):  # first choices before second choices
                    for tok in choice:
                        e = tok[slot]
                        if used[e] < cap:
                            used[e] += 1
                        else:
                            dropped[i][e] += 1
    return dropped


def test_small_capacity_drops_same_tokens_as_one_rank(tmp_path, session_dir):
    cap = ("model.capacity_factor=0.75", *K2)
    reference = ref(session_dir, 4, *cap)
    run = train_layout(tmp_path / "run", 4, *MOE, "topology.dp=4", "topology.ep=2", *cap)
    assert_same(run, reference, rel=1e-9, what="capacity 0.75, dp=4 ep=2")
    check_moe_metrics(run, reference)
    expected = independent_drop_count((*MOE, *cap), global_mb=4)
    assert run.metrics[0]["moe_dropped"] == expected
    assert run.metrics[0]["moe_dropped_total"] > 0  # the capacity really binds
    load = np.array(list(run.metrics[0]["moe_load"].values()))
    assert load.sum() == 4 * 2 * 16 * 16  # layers * k * tokens of the global batch
