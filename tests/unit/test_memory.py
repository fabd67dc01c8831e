"""The plan's memory arithmetic (no MPI): ZeRO divides state by dp, the fit warning."""

import subprocess
import sys

import pytest

from hpctrain.config import load
from hpctrain.planner import memory

TINY = "share/configs/tiny.toml"


def test_zero_divides_optimizer_state_and_gradients():
    est = {z: memory.estimate(load(TINY, ["topology.dp=4", f"optim.zero={z}"]))
           for z in (0, 1, 2)}
    assert est[1].optimizer * 4 == est[0].optimizer
    assert est[1].grads > est[0].grads > est[2].grads  # z1 adds a shard, z2 keeps only it
    assert est[0].params == est[1].params == est[2].params
    assert est[0].comm["dp"] == est[1].comm["dp"]  # reduce-scatter + all-gather = all-reduce


def test_zero3_divides_parameters_gradients_and_state():
    """zero 3: parameters, gradients and optimizer state ~1/dp (plus a few gathered blocks);
    the plan's memory and its dp traffic (two gathers and a reduce-scatter per microbatch)."""
    cfg = {d: load(TINY, [f"topology.dp={d}", "optim.zero=3", "model.n_layers=32"])
           for d in (1, 2, 4)}
    est = {d: memory.estimate(c) for d, c in cfg.items()}
    block, at_once = memory.gathered(cfg[4])
    ps = memory.DTYPE_BYTES[cfg[1].model.dtype]
    whole = est[1].params - at_once * ps  # the stage's parameter bytes
    for d in (2, 4):
        assert est[d].optimizer * d == est[1].optimizer
        assert est[d].params == whole // d + at_once * ps
        assert est[d].grads == est[1].grads - whole * (d - 1) // d
    assert est[4].params < est[2].params < est[1].params
    z2 = memory.estimate(load(TINY, ["topology.dp=4", "optim.zero=2", "model.n_layers=32"]))
    assert est[4].params < z2.params / 2 and est[4].comm["dp"] > z2.comm["dp"]
    assert block < at_once


def test_zero3_split_backward_gathers_as_1f1b():
    """zb-h1 and zbv's W reads no weight (model/weight_grad.py): 2 gathers + 1 reduce-scatter
    of the stage's parameters per microbatch, as 1f1b."""
    base = ["topology.dp=2", "topology.pp=2", "optim.zero=3"]
    P, M = 1000, 4
    dp = {k: memory.comm_volume(load(TINY, [*base, f'schedule.kind="{k}"']), P, 4, M)["dp"]
          for k in ("1f1b", "zb-h1", "zbv")}
    assert dp["zb-h1"] == dp["1f1b"] == dp["zbv"] == 3 * M * P * 4 // 2


def test_gpipe_holds_all_microbatches_1f1b_at_most_pp():
    base = ["topology.pp=2", "train.global_batch_size=16"]
    g = load(TINY, [*base, "schedule.kind=gpipe"])
    f = load(TINY, [*base, "schedule.kind=1f1b"])
    assert memory.in_flight(g) == 16 and memory.in_flight(f) == 2
    assert memory.estimate(g).activations > 4 * memory.estimate(f).activations


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("512MB", 512 * 2**20),
                                        ("1e9", 10**9), ("4k", 4096)])
def test_parse_bytes(text, value):
    assert memory.parse_bytes(text) == value


def test_plan_cli_prints_memory_and_warns():
    cmd = [sys.executable, "-m", "hpctrain", "plan", TINY, "--world-size", "2",
           "--set", "topology.dp=2", "--set", "optim.zero=2"]
    ok = subprocess.run([*cmd, "--memory-per-rank", "1GiB"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "memory per rank" in ok.stdout and "fits:" in ok.stdout
    assert "communication per rank per step: dp" in ok.stdout
    tight = subprocess.run([*cmd, "--memory-per-rank", "100KiB"], capture_output=True,
                           text=True)
    assert "WARNING: needs" in tight.stdout
    bad = subprocess.run([*cmd, "--memory-per-rank", "lots"], capture_output=True, text=True)
    assert bad.returncode == 2 and "memory size 'lots'" in bad.stderr


@pytest.mark.parametrize("preset", [TINY, "share/configs/tiny-llama.toml"])
@pytest.mark.parametrize("experts", ["model.num_experts=0", "model.num_experts=4"])
def test_parameter_estimate_counts_the_model(preset, experts):
    """The plan's parameter bytes are the model's (GQA, SwiGLU and Mixtral experts too)."""
    import torch

    from hpctrain.model import DecoderStage, LocalOps
    from hpctrain.model.moe import LocalExchange, MoE

    cfg = load(preset, [experts, "model.moe_every=2"])
    m = cfg.model
    stage = DecoderStage(m, range(m.n_layers), True, True, ffn_factory=lambda i: MoE(
        m, LocalOps(), LocalExchange(), torch.float64, 0.01) if m.moe_layer(i) else None)
    count = sum(p.numel() for p in stage.parameters())
    assert memory.estimate(cfg).params == count * 8


def test_latent_attention_parameters_and_kv_cache():
    """DeepSeek-V3's parameters (latent attention, the first block dense, shared experts) on
    one rank and tp = 2 (the down projections on both ranks), and its KV cache: the latent
    and the rotary key per token and layer."""
    import torch

    from hpctrain.model import DecoderStage, LocalOps
    from hpctrain.model.moe import LocalExchange, MoE

    sets = ["model.family=\"deepseek_v3\"", "model.n_kv_heads=0", "model.q_lora_rank=12",
            "model.kv_lora_rank=16", "model.qk_nope_dim=8", "model.qk_rope_dim=4",
            "model.v_head_dim=6", "model.num_experts=4", "model.dense_layers=1",
            "model.shared_experts=1", "model.expert_d_ff=16", "model.router_score=\"sigmoid\""]
    for tp in (1, 2):
        cfg = load("share/configs/tiny-llama.toml", [*sets, f"topology.tp={tp}"])
        m = cfg.model

        class Ops(LocalOps):
            tp_size = tp

        stage = DecoderStage(m, range(m.n_layers), True, True, ops=Ops(),
                             ffn_factory=lambda i, m=m: MoE(m, Ops(), LocalExchange(),
                                                            torch.float64, 0.01)
                             if m.moe_layer(i) else None)
        count = sum(p.numel() for p in stage.parameters())
        assert memory.estimate(cfg).params == count * 8, tp
    text = memory.report(cfg)
    per_token = (16 + 4) * m.n_layers * 8
    assert f"KV cache of generation: {memory.fmt_bytes(per_token)} per token" in text
