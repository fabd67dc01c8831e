"""DeepSeek-style experts without MPI: group-limited selection, the selection bias (picks,
never weighs), its update, shared experts with their gate, fine-grained experts, and what
``plan`` counts for them."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.config import Config, ModelConfig, TopologyConfig, TrainConfig
from hpctrain.model import routing
from hpctrain.model.families import family_of
from hpctrain.model.moe import LocalExchange, MoE
from hpctrain.model.stage import DecoderStage, LocalOps, init_parameters
from hpctrain.planner import flops, memory

DEEPSEEK = ModelConfig(arch="llama", n_layers=2, d_model=8, n_heads=2, d_ff=32, num_experts=8,
                       top_k=3, expert_d_ff=4, shared_experts=2, shared_expert_gate=True,
                       router_score="sigmoid", norm_topk_prob="true", routed_scaling_factor=2.5,
                       bias_update_rate=0.01, route_groups=4, route_top_groups=2,
                       dtype="float64", init_std=0.5, vocab_size=32)


def layer_of(m: ModelConfig, ops=None) -> MoE:
    layer = MoE(m, ops or LocalOps(), LocalExchange(), torch.float64, 0.3)
    holder = torch.nn.Module()
    holder.mlp = layer
    init_parameters([holder], 0)
    return layer


def naive_select(scores, k, bias, groups, top_groups):
    """Per token, in plain Python: its best groups by the sum of their two best biased
    scores, then its k best biased scores among those groups' experts."""
    scores, bias, (n, E) = scores.detach(), bias.detach(), scores.shape
    size = E // groups
    out = []
    for t in range(n):
        choice = [float(scores[t, e] + bias[e]) for e in range(E)]
        group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:top_groups or groups]
        allowed = [e for e in range(E) if e // size in kept]
        out.append(sorted(sorted(allowed, key=lambda e: -choice[e])[:k]))
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(8, 4, 2, 3), (8, 2, 1, 2), (12, 3, 2, 4), (6, 6, 3, 3), (4, 1, 0, 2)]),
       st.integers(0, 2**31 - 1))
def test_group_limited_selection_matches_a_per_token_loop(shape, seed):
    E, groups, top_groups, k = shape
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(7, E, generator=g, dtype=torch.float64)
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
    picked = routing.select(scores, k, bias, groups, top_groups)
    assert sorted(map(sorted, picked.tolist())) == sorted(
        naive_select(scores, k, bias, groups, top_groups))
    size = E // groups
    for row, experts in zip(scores + bias, picked.tolist()):  # all within the top groups
        kept = row.view(groups, size).topk(min(2, size), -1).values.sum(-1).topk(
            top_groups or groups).indices.tolist()
        assert all(e // size in kept for e in experts)


def test_bias_changes_the_pick_but_not_the_weights():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2]], dtype=torch.float64)
    plain = routing.select(scores, 2)
    assert plain.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    biased = routing.select(scores, 2, bias)
    assert biased.tolist() == [[2, 0]]
    w = routing.weights(scores, biased, renormalise=False)
    assert w.tolist() == [[0.1, 0.9]]  # the scores, not scores + bias
    w = routing.weights(scores, biased, renormalise=True, scale=2.5)
    torch.testing.assert_close(w, torch.tensor([[0.25, 2.25]], dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=16), st.floats(1e-4, 0.1))
def test_bias_step_moves_against_the_load(load, rate):
    bias = torch.zeros(len(load), dtype=torch.float64)
    new = routing.bias_step(bias, load, rate)
    mean = sum(load) / len(load)
    for b, n in zip(new.tolist(), load):
        assert b == (rate if n < mean else -rate if n > mean else 0.0)


def naive_layer(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token: sigmoid scores, group-limited biased pick, renormalised scaled weights,
    SwiGLU experts, plus the gated SwiGLU shared experts."""
    m, out = layer.cfg, torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(layer.router @ x[t])
        experts = naive_select(s.unsqueeze(0), m.top_k, layer.route_bias, m.route_groups,
                               m.route_top_groups)[0]
        w = s[experts] / s[experts].sum() * m.routed_scaling_factor
        for wi, e in zip(w, experts):
            out[t] += wi * (layer.w2[e] @ (F.silu(layer.w1[e] @ x[t]) * (layer.w3[e] @ x[t])))
        sh = layer.shared
        shared = sh.w2 @ (F.silu(sh.w1 @ x[t]) * (sh.w3 @ x[t]))
        out[t] += torch.sigmoid(layer.shared_gate[0] @ x[t]) * shared
    return out


def test_layer_with_every_option_matches_a_per_token_loop():
    layer = layer_of(DEEPSEEK)
    assert tuple(layer.w1.shape) == (8, 4, 8)  # fine-grained: expert_d_ff, not d_ff
    assert tuple(layer.shared.w1.shape) == (8, 8)  # shared_experts * expert_d_ff
    with torch.no_grad():
        layer.route_bias.copy_(torch.linspace(-0.2, 0.2, 8, dtype=torch.float64))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x).reshape(-1, 8), naive_layer(layer, x.reshape(-1, 8)))


def test_bias_follows_the_trained_load_only():
    layer = layer_of(DEEPSEEK)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():  # evaluation: not counted
        layer(x)
    assert layer.routed.sum() == 0
    layer(x).sum().backward()
    layer.update_bias(applied=False)  # a skipped step: its load is dropped, the bias kept
    assert layer.routed.sum() == 0 and layer.route_bias.abs().sum() == 0
    layer(x).sum().backward()
    load = layer.routed.copy()
    assert load.sum() == 12 * 3
    layer.update_bias()
    mean = load.mean()
    assert layer.route_bias.tolist() == [0.01 if n < mean else -0.01 if n > mean else 0.0
                                         for n in load]
    assert layer.routed.sum() == 0  # counting starts afresh
    assert layer_of(replace(DEEPSEEK, bias_update_rate=0.0)).route_bias is None


def test_defaults_route_as_before():
    m = replace(DEEPSEEK, arch="gpt", top_k=2, expert_d_ff=0, shared_experts=0,
                shared_expert_gate=False, router_score="softmax", norm_topk_prob="auto",
                routed_scaling_factor=1.0, bias_update_rate=0.0, route_groups=1,
                route_top_groups=0)
    layer = layer_of(m)
    assert layer.shared is None and not hasattr(layer, "shared_gate")
    assert tuple(layer.w1.shape) == (8, 32, 8)
    x = torch.randn(6, 8, dtype=torch.float64)
    _, probs, expert, gate = layer.route(x)
    p = torch.softmax(x @ layer.router.T, -1)
    g, e = p.topk(2)
    assert torch.equal(expert, e)
    torch.testing.assert_close(gate, g / g.sum(-1, keepdim=True))


class TwoRanks(LocalOps):
    tp_size = 2


def test_plan_counts_shared_and_fine_grained_experts():
    m = DEEPSEEK
    stage = DecoderStage(m, range(2), True, True, ffn_factory=lambda i: MoE(
        m, LocalOps(), LocalExchange(), torch.float64, 0.3))
    cfg = Config(model=m, topology=TopologyConfig(), train=TrainConfig(seq_len=8))
    assert memory.stage_params(cfg, 2, True, True) == sum(p.numel() for p in stage.parameters())
    half = MoE(m, TwoRanks(), LocalExchange(), torch.float64, 0.3)  # shared experts over tp
    assert family_of(m).expert_params(m, 2, 2) == sum(
        p.numel() for p in half.parameters()) - 4 * half.w1[0].numel() * 3


def test_flops_count_the_active_routed_and_shared_experts():
    layer = layer_of(DEEPSEEK)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    with FlopCounterMode(display=False) as fc:
        layer(x)
    per_token = family_of(DEEPSEEK).flop_terms(DEEPSEEK, 1).moe_mlp
    assert fc.get_total_flops() == pytest.approx(per_token * 20)
    assert flops.moe_layer_count(DEEPSEEK) == 2
    assert np.isfinite(flops.train_flops_per_token(DEEPSEEK, 8))


def test_mixtral_export_refuses_what_it_cannot_express():
    assert family_of(replace(DEEPSEEK, n_layers=2)).name == "mixtral"
    refusal = family_of(DEEPSEEK).hf.refusal(DEEPSEEK)
    for key in ("shared_experts", "router_score", "routed_scaling_factor", "bias_update_rate",
                "route_top_groups", "expert_d_ff"):
        assert f"model.{key} = " in refusal
    plain = ModelConfig(arch="llama", num_experts=4, norm_topk_prob="true", route_groups=2)
    assert family_of(plain).hf.refusal(plain) is None


def test_init_from_reads_the_default_expert_sizes_as_what_they_mean():
    from hpctrain.interchange.init_from import differences

    same = replace(DEEPSEEK, expert_d_ff=32, shared_expert_d_ff=64)  # d_ff, 2 x expert
    assert differences(replace(DEEPSEEK, expert_d_ff=0, shared_expert_d_ff=0), same) == []
    assert differences(DEEPSEEK, same) == ["model.expert_d_ff = 4, the source has 32",
                                           "model.shared_expert_d_ff = 8, the source has 64"]


def test_generation_reads_the_selection_bias():
    from hpctrain.interchange.generation import _filled, whole_model

    model = whole_model(DEEPSEEK)
    saved = {n: np.zeros(tuple(p.shape)) for n, p in model.named_parameters()}
    saved.update({f"blocks.{i}.mlp.route_bias": np.full(8, 0.5) for i in (0, 1)})
    _filled(model, saved.__getitem__)
    assert [float(model.blocks[str(i)].mlp.route_bias.sum()) for i in (0, 1)] == [4.0, 4.0]
