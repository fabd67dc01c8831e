"""The llama / Mixtral form of the model on one process (no MPI): incremental decoding with a
KV cache equals the full-sequence forward for both architectures, dense and MoE; the
conventions (rotary, grouped-query attention, SwiGLU, Mixtral routing, parameter names)
are those of Hugging Face's LlamaForCausalLM / MixtralForCausalLM, checked against them."""

import math
from dataclasses import replace

import pytest
import torch

from hpctrain.config import load
from hpctrain.model import DecoderStage, KVCache, LocalOps, init_parameters
from hpctrain.model.layers import Rotary
from hpctrain.model.moe import LocalExchange, MoE

TINY_LLAMA = "share/configs/tiny-llama.toml"


def model_cfg(arch: str, experts: int = 0, **extra):
    m = load(TINY_LLAMA).model
    m = replace(m, arch=arch, n_kv_heads=4 if arch == "llama" else 0, num_experts=experts,
                moe_every=2, top_k=2, init_std=0.2, **extra)
    return m


def build(m, seed: int = 5) -> DecoderStage:
    resid = m.init_std / math.sqrt(2 * m.n_layers)
    ex = LocalExchange()
    factory = (lambda i: MoE(m, LocalOps(), ex, torch.float64, resid)
               if m.moe_layer(i) else None) if m.num_experts else None
    stage = DecoderStage(m, range(m.n_layers), True, True, ffn_factory=factory)
    init_parameters([stage], seed)
    return stage.eval()


@pytest.mark.parametrize("arch,experts", [("gpt", 0), ("llama", 0), ("gpt", 4), ("llama", 4)])
def test_cached_decoding_equals_full_sequence(arch, experts):
    stage = build(model_cfg(arch, experts))
    idx = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    full = stage.logits(idx)  # (B, T, V)
    cache = KVCache()
    parts = [stage.logits(idx[:, :5], cache)]  # a prompt, then one token at a time, then 3
    for t in range(5, 10):
        parts.append(stage.logits(idx[:, t:t + 1], cache))
    parts.append(stage.logits(idx[:, 10:], cache))
    assert cache.length == 13 and cache.k[0].shape[2] == 13
    got = torch.cat(parts, dim=1)
    err = (got - full).abs().max().item() / full.abs().max().item()
    assert err <= 1e-10, err


def test_parameter_names_and_shapes():
    m = model_cfg("llama", 4)
    stage = build(m)
    shapes = {n: tuple(p.shape) for n, p in stage.named_parameters()}
    C, H, hd, kv, E, V = m.d_model, m.ffn_dim, m.head_dim, m.kv_heads, 4, m.vocab_size
    assert shapes["embed"] == (V, C) and shapes["head"] == (V, C)
    assert shapes["blocks.0.attn.wq"] == (m.n_heads * hd, C)
    assert shapes["blocks.0.attn.wk"] == shapes["blocks.0.attn.wv"] == (kv * hd, C)
    assert shapes["blocks.0.attn.wo"] == (C, m.n_heads * hd)
    assert shapes["blocks.0.mlp.w1"] == shapes["blocks.0.mlp.w3"] == (H, C)
    assert shapes["blocks.0.mlp.w2"] == (C, H)
    assert shapes["blocks.1.mlp.router"] == (E, C)
    assert shapes["blocks.1.mlp.w1"] == shapes["blocks.1.mlp.w3"] == (E, H, C)
    assert shapes["blocks.1.mlp.w2"] == (E, C, H)
    assert shapes["blocks.0.norm1.weight"] == shapes["norm_f.weight"] == (C,)
    assert "blocks.0.mlp.w3" not in dict(build(model_cfg("gpt")).named_parameters())


def test_rotary_tables_are_cached_and_grow():
    rot = Rotary(8, 10000.0)
    a = rot.cos_sin(0, 4, torch.float64, "cpu")[0]
    table = rot.tables[(torch.float64, "cpu")][0]
    assert rot.cos_sin(1, 3, torch.float64, "cpu")[0].data_ptr() != 0
    assert rot.tables[(torch.float64, "cpu")][0] is table  # no recomputation within length
    b = rot.cos_sin(10, 2, torch.float64, "cpu")[0]  # grows, the same values
    assert torch.equal(rot.cos_sin(0, 4, torch.float64, "cpu")[0], a)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.allclose(b[1, :4], torch.cos(11 * inv), atol=0, rtol=1e-15)


def _hf_config(m, experts: int):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                  num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                  num_key_value_heads=m.kv_heads, rms_norm_eps=m.norm_eps,
                  tie_word_embeddings=False, max_position_embeddings=64,
                  rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta})
    if experts:  # the eager expert loop: the grouped matmul kernel has no float64
        cfg = MixtralConfig(num_local_experts=experts, num_experts_per_tok=m.top_k, **common)
        cfg._experts_implementation = "eager"
        return cfg
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _hf_state(stage, experts: int) -> dict:
    """hpctrain's parameters under Hugging Face's names, no permutation."""
    p = dict(stage.named_parameters())
    out = {"model.embed_tokens.weight": p["embed"], "lm_head.weight": p["head"],
           "model.norm.weight": p["norm_f.weight"]}
    for i in stage.layers:
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in (("norm1.weight", "input_layernorm.weight"),
                             ("norm2.weight", "post_attention_layernorm.weight"),
                             ("attn.wq", "self_attn.q_proj.weight"),
                             ("attn.wk", "self_attn.k_proj.weight"),
                             ("attn.wv", "self_attn.v_proj.weight"),
                             ("attn.wo", "self_attn.o_proj.weight")):
            out[h + theirs] = p[b + ours]
        if experts:  # every block an MoE block (moe_every=1)
            out[h + "mlp.gate.weight"] = p[b + "mlp.router"]
            out[h + "mlp.experts.gate_up_proj"] = torch.cat([p[b + "mlp.w1"], p[b + "mlp.w3"]],
                                                            dim=1)
            out[h + "mlp.experts.down_proj"] = p[b + "mlp.w2"]
        else:
            out[h + "mlp.gate_proj.weight"] = p[b + "mlp.w1"]
            out[h + "mlp.up_proj.weight"] = p[b + "mlp.w3"]
            out[h + "mlp.down_proj.weight"] = p[b + "mlp.w2"]
    return out


@pytest.mark.parametrize("experts", [0, 4])
def test_same_logits_as_hugging_face(experts):
    """The llama form is Hugging Face's LlamaForCausalLM (and with experts
    MixtralForCausalLM) with the same weights under other names. Hugging Face normalises
    and builds its rotary tables in float32 even for a float64 model, so the agreement is
    float32's (a wrong convention differs by O(1))."""
    import transformers

    m = model_cfg("llama", experts, rope_theta=500.0)
    m = replace(m, moe_every=1, n_layers=3)
    stage = build(m)
    hf_cls = transformers.MixtralForCausalLM if experts else transformers.LlamaForCausalLM
    hf = hf_cls(_hf_config(m, experts)).to(torch.float64).eval()
    missing, unexpected = hf.load_state_dict(_hf_state(stage, experts), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], missing
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
    got = stage.logits(idx)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= 1e-5, err
