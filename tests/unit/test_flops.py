"""Model FLOPs per token against PyTorch's own FLOP counter on a real forward + backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.config import ModelConfig
from hpctrain.model.stage import DecoderStage
from hpctrain.planner.flops import (
    forward_flops_per_token,
    moe_layer_count,
    train_flops_per_token,
)
from hpctrain.telemetry.peak import measure_peak_flops


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def attention_core_flops(B, H, T, hd) -> int:
    """QK^T and AV, forward and backward, measured on an explicit (unmasked) attention."""
    q, k, v = (torch.randn(B, H, T, hd, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def run():
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        (att @ v).sum().backward()

    return counted_flops(run)


@pytest.mark.parametrize("layers,C,H,F,V,T,arch,kv", [
    (2, 32, 4, 48, 100, 16, "gpt", 0), (3, 64, 8, 0, 256, 8, "gpt", 0),
    (2, 32, 4, 48, 100, 16, "llama", 2),  # grouped-query attention, SwiGLU
])
def test_dense_train_flops_match_flop_counter(layers, C, H, F, V, T, arch, kv):
    m = ModelConfig(n_layers=layers, d_model=C, n_heads=H, d_ff=F, vocab_size=V,
                    dtype="float64", arch=arch, n_kv_heads=kv)
    stage = DecoderStage(m, range(layers), True, True)
    for p in stage.parameters():
        torch.nn.init.normal_(p, std=0.02)
    B = 2
    x = torch.randint(0, V, (B, T))
    # The CPU SDPA kernel is invisible to FlopCounterMode: count the linear layers there and
    # the attention core (QK^T, AV) on an explicit implementation of the same shapes.
    linear = counted_flops(lambda: stage(x, x).backward())
    core = layers * attention_core_flops(B, H, T, C // H)
    assert linear + core == pytest.approx(train_flops_per_token(m, T, causal=False) * B * T)


def test_causal_counts_the_mean_context():
    m = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=128)
    T = 32
    full = forward_flops_per_token(m, T, causal=False)
    causal = forward_flops_per_token(m, T, causal=True)
    assert full - causal == pytest.approx(4 * 2 * 2 * 64 * (T - (T + 1) / 2))


def test_moe_counts_router_and_top_k_active_experts():
    dense = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=128)
    moe = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=128, num_experts=8,
                      top_k=2, moe_every=2)
    assert moe_layer_count(moe) == 2 and moe_layer_count(dense) == 0
    for cfg in (moe, ModelConfig(n_layers=7, num_experts=4, moe_every=3), dense):
        assert moe_layer_count(cfg) == sum(cfg.moe_layer(i) for i in range(cfg.n_layers))
    C, F = 64, 256
    extra_per_moe_layer = 2 * C * 8 + (2 - 1) * 2 * 2 * C * F  # router + one more expert
    assert forward_flops_per_token(moe, 16) - forward_flops_per_token(dense, 16) == \
        pytest.approx(2 * extra_per_moe_layer)
    # The number of experts held changes only the router, never the active compute.
    many = ModelConfig(**{**moe.__dict__, "num_experts": 64})
    assert forward_flops_per_token(many, 16) - forward_flops_per_token(moe, 16) == \
        pytest.approx(2 * 2 * C * (64 - 8))


def test_peak_probe_is_positive_and_finite():
    peak = measure_peak_flops(torch.float64, "cpu", seconds=0.05)
    assert 1e6 < peak < 1e15


def test_latent_attention_flops_match_flop_counter():
    """DeepSeek-V3's latent attention, projections and core (keys of qk_nope_dim +
    qk_rope_dim channels, values of v_head_dim), against the FLOP counter: with values
    narrower than keys SDPA runs its math path, whose matmuls the counter sees."""
    from hpctrain.model.families import family_of
    from hpctrain.model.latent import LatentAttention
    from hpctrain.model.layers import Rotary
    from hpctrain.model.stage import LocalOps

    for q_lora in (12, 0):
        m = ModelConfig(family="deepseek_v3", arch="llama", n_layers=1, d_model=32, n_heads=4,
                        q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4,
                        v_head_dim=6, num_experts=4, dtype="float64")
        attn = LatentAttention(m, LocalOps(), torch.float64, 0.02, Rotary(4, 1e4))
        for p in attn.parameters():
            torch.nn.init.normal_(p, std=0.02)
        B, T = 2, 8
        x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
        counted = counted_flops(lambda: attn(x).sum().backward())  # noqa: B023
        terms = family_of(m).flop_terms(m, T)
        assert counted == pytest.approx(3 * terms.attention * B * T), q_lora
