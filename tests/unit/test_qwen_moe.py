"""The Qwen families and their attention options without MPI or transformers: which family a
config is, what maps between an HF config.json and the model keys, what is refused (import
and export), and what q/k norms, q/k/v biases and heads of any size compute."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checks.validate import validate
from hpctrain.config import ConfigError, ModelConfig, load
from hpctrain.interchange import generation, hf_map, init_from
from hpctrain.model import families
from hpctrain.model.layers import Attention, Rotary
from hpctrain.model.stage import LocalOps, init_parameters

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
QWEN3_HF = {**BASE, "model_type": "qwen3_moe", "head_dim": 6, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False}
QWEN2_HF = {**BASE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 24,
            "norm_topk_prob": False, "decoder_sparse_step": 2, "qkv_bias": True,
            "use_sliding_window": False, "sliding_window": 0,
            "layer_types": ["full_attention"] * 2}
MOE = dict(arch="llama", n_layers=2, d_model=32, n_heads=8, n_kv_heads=4, num_experts=4,
           top_k=2)
QWEN3 = ModelConfig(**MOE, qk_norm=True, d_head=6, expert_d_ff=16)
QWEN2 = ModelConfig(**MOE, qkv_bias=True, shared_experts=1, shared_expert_d_ff=24,
                    shared_expert_gate=True, moe_every=2, expert_d_ff=16)
FULL = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
        "layer_types": ["full_attention"] * 2}
DENSE_HF = {k: v for k, v in BASE.items() if "expert" not in k and not k.startswith("moe")}
DENSE3_HF = {**DENSE_HF, **FULL, "model_type": "qwen3", "head_dim": 6, "attention_bias": False}
DENSE2_HF = {**DENSE_HF, **FULL, "model_type": "qwen2", "tie_word_embeddings": True}
DENSE = dict(arch="llama", n_layers=2, d_model=32, n_heads=8, n_kv_heads=4, d_ff=64,
             rope_theta=1e6, norm_eps=1e-6)
DENSE3 = ModelConfig(**DENSE, family="qwen3", qk_norm=True, d_head=6)
DENSE2 = ModelConfig(**DENSE, family="qwen2", qkv_bias=True, tie_embeddings=True)


@pytest.mark.parametrize("kw, name", [
    (dict(MOE), "mixtral"), (dict(MOE, qk_norm=True), "qwen3_moe"),
    (dict(MOE, shared_experts=1, shared_expert_gate=True, qkv_bias=True), "qwen2_moe"),
    (dict(MOE, shared_experts=1, shared_expert_gate=True), "mixtral"),  # DeepSeek-style
    (dict(MOE, shared_experts=1, qkv_bias=True), "mixtral"),
    (dict(MOE, qk_norm=True, shared_experts=1, shared_expert_gate=True), "qwen3_moe"),
    (dict(arch="llama", qk_norm=True, qkv_bias=True), "llama"),
    (dict(arch="llama", qk_norm=True), "llama"),  # an older config keeps its family
    (dict(arch="llama", qkv_bias=True), "llama"),
    (dict(arch="llama", qk_norm=True, family="qwen3"), "qwen3"),  # dense Qwen: by name
    (dict(arch="llama", qkv_bias=True, family="qwen2"), "qwen2"),
])
def test_every_config_has_one_family(kw, name):
    assert families.family_of(ModelConfig(**kw)).name == name


@pytest.mark.parametrize("hf, m", [(QWEN3_HF, QWEN3), (QWEN2_HF, QWEN2)])
def test_hf_config_maps_to_model_keys_and_back(hf, m):
    section = hf_map.model_section(hf)
    got = ModelConfig(**section)
    assert got.family == hf["model_type"]  # the import names the family
    assert replace(got, rope_theta=m.rope_theta, norm_eps=m.norm_eps, init_std=m.init_std,
                   d_ff=0, norm_topk_prob="auto", family="") == replace(m, d_ff=0)
    assert got.ffn_dim == 64 and got.norm_topk_prob == str(hf["norm_topk_prob"]).lower()
    back = hf_map.hf_config(got, 64, "float32", {})
    for key, value in hf.items():
        if key != "rope_parameters":
            assert back[key] == value, key
    assert back["rope_parameters"]["rope_theta"] == 1e6
    assert back["architectures"] == [families.family_of(got).hf.architecture]


@pytest.mark.parametrize("hf, m", [(DENSE3_HF, DENSE3), (DENSE2_HF, DENSE2)])
def test_dense_hf_config_maps_to_model_keys_and_back(hf, m):
    got = ModelConfig(**hf_map.model_section(hf))
    assert replace(got, init_std=m.init_std, vocab_size=m.vocab_size) == m
    back = hf_map.hf_config(got, 64, "float32", {})
    for key, value in hf.items():
        if key != "rope_parameters":
            assert back[key] == value, key
    assert back["architectures"] == [families.family_of(got).hf.architecture]
    assert ("attention_bias" in back) == (m.family == "qwen3")  # Qwen2 has q/k/v biases always


@pytest.mark.parametrize("m", [QWEN3, QWEN2, replace(QWEN3, moe_every=2, tie_embeddings=True),
                               DENSE3, DENSE2])
def test_every_parameter_maps_to_hf_once(m):
    names = {n for n, _ in generation.whole_model(m).named_parameters()}
    entries = hf_map.entries(m)
    assert {e.name for e in entries} == names
    assert len({e.key for e in entries}) == len(entries)


@pytest.mark.parametrize("hf, change, words", [
    (QWEN3_HF, {"mlp_only_layers": [0]}, "mlp_only_layers"),
    (QWEN3_HF, {"attention_bias": True}, "attention_bias"),
    (QWEN3_HF, {"use_sliding_window": True, "sliding_window": 8}, "sliding_window"),
    (QWEN3_HF, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    (QWEN2_HF, {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    (QWEN2_HF, {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    (QWEN2_HF, {"qkv_bias": False}, "qkv_bias = false"),
    (QWEN2_HF, {"hidden_act": "gelu"}, "hidden_act"),
    (DENSE3_HF, {"attention_bias": True}, "attention_bias"),
    (DENSE3_HF, {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    (DENSE2_HF, {"use_sliding_window": True, "sliding_window": 8}, "sliding_window"),
    (DENSE2_HF, {"use_sliding_window": True}, "use_sliding_window"),
])
def test_what_hpctrain_cannot_hold_is_refused_on_import(hf, change, words):
    with pytest.raises(hf_map.InterchangeError, match=words):
        hf_map.model_section({**hf, **change})


@pytest.mark.parametrize("m, words", [
    (ModelConfig(arch="llama", qk_norm=True), "model.qk_norm = true"),
    (ModelConfig(**MOE, qkv_bias=True), "model.qkv_bias = true"),  # mixtral
    (replace(QWEN3, qkv_bias=True), "output projection"),
    (replace(QWEN3, shared_experts=1), "no shared experts"),
    (replace(QWEN2, router_score="sigmoid"), "router_score"),
    (replace(QWEN2, routed_scaling_factor=2.5), "routed_scaling_factor"),
    (replace(QWEN3, bias_update_rate=1e-3), "selection bias"),
    (replace(QWEN3, route_groups=2, route_top_groups=1), "route_top_groups"),
    (replace(QWEN2, capacity_factor=1.25), "capacity_factor"),
    (ModelConfig(arch="llama", qkv_bias=True), "model.family = 'qwen3'"),
    (replace(DENSE3, qkv_bias=True), "output projection"),
    (replace(DENSE2, qk_norm=True), "no q/k norms"),
])
def test_what_transformers_cannot_express_is_refused_on_export(m, words):
    with pytest.raises(hf_map.InterchangeError, match=words):
        hf_map.check_exportable(m)


def test_norm_topk_prob_is_exported_as_the_router_uses_it():
    fam = families.family_of(QWEN2)
    assert fam.hf.config(QWEN2, 64, "float32", {})["norm_topk_prob"] is True  # auto, k=2
    for value in ("true", "false"):
        m = replace(QWEN2, norm_topk_prob=value)
        assert fam.hf.config(m, 64, "float32", {})["norm_topk_prob"] is (value == "true")


def test_head_size_key():
    """d_head: heads of any size (d_model need not divide by n_heads); 0 and the size it
    means are the same model for init_from."""
    assert ModelConfig(d_model=32, n_heads=8).head_dim == 4
    assert ModelConfig(d_model=30, n_heads=8, d_head=6).head_dim == 6
    validate(load(TINY, ["model.arch=llama", "model.d_model=30", "model.d_head=6"]), 1)
    with pytest.raises(ConfigError, match="model.d_head"):
        validate(load(TINY, ["model.d_model=30"]), 1)
    with pytest.raises(ConfigError, match="must be even"):
        validate(load(TINY, ["model.arch=llama", "model.d_head=5"]), 1)
    a, b = ModelConfig(arch="llama"), ModelConfig(arch="llama", d_head=32)
    assert init_from.differences(a, b) == []
    assert init_from.differences(a, replace(b, d_head=16)) == [
        "model.d_head = 32, the source has 16"]


def attention(cfg: ModelConfig, seed=0) -> Attention:
    layer = Attention(cfg, LocalOps(), torch.float64, 0.02, Rotary(cfg.head_dim, 1e4))
    init_parameters([layer], seed=seed)
    return layer


@settings(max_examples=10, deadline=None)
@given(scale=st.lists(st.floats(0.1, 10.0), min_size=12, max_size=12),
       seed=st.integers(0, 2**16))
def test_qk_norm_forgets_the_scale_of_each_head(scale, seed):
    """With q/k norms, scaling each query and key head's projection rows by any positive
    factor leaves the attention unchanged."""
    cfg = ModelConfig(arch="llama", d_model=16, n_heads=8, n_kv_heads=4, d_head=6,
                      qk_norm=True, norm_eps=1e-300, dtype="float64")
    layer = attention(cfg, seed)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    ref = layer(x)
    s = torch.tensor(scale, dtype=torch.float64).repeat_interleave(6).unsqueeze(1)
    with torch.no_grad():
        layer.wq.mul_(s[:48])
        layer.wk.mul_(s[48:])
    torch.testing.assert_close(layer(x), ref, rtol=1e-9, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_value_bias_shifts_every_output_by_its_projection(seed):
    """A value bias b_v moves each token's output by wo (b_v per query head), since the
    attention weights of a query sum to 1; zero biases are no biases."""
    cfg = ModelConfig(arch="llama", d_model=16, n_heads=4, n_kv_heads=2, qkv_bias=True,
                      dtype="float64")
    layer = attention(cfg, seed)
    plain = attention(replace(cfg, qkv_bias=False), seed)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)
    bv = torch.randn(8, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    with torch.no_grad():
        layer.bv.copy_(bv)
    shift = layer.wo @ bv.view(2, 4).repeat_interleave(2, dim=0).reshape(-1)
    torch.testing.assert_close(layer(x), plain(x) + shift, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m, words", [(replace(DENSE3, qk_norm=False), "has q/k norms"),
                                      (replace(DENSE2, qkv_bias=False), "has q/k/v biases")])
def test_a_dense_qwen_family_without_its_flag_is_refused_by_the_checks(m, words):
    with pytest.raises(ConfigError, match=f"model.family='{m.family}' {words}"):
        validate(replace(load(TINY), model=m), 1)
