"""The model-family seam (``hpctrain/model/families/``): a config names its family
(``model.family``), an older one gets the family its arch and flags meant (the same as before
the key existed, for every preset and flag combination), a run records it, nothing outside the
registry tests ``model.arch``, and a family added inside a test (its class plus one registry
entry, selected by name) builds a stage, counts its FLOPs and parameters and runs its checks
with no other module edited."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.checks.rules import problems
from hpctrain.config import ARCHS, Config, ModelConfig, TopologyConfig, TrainConfig, load
from hpctrain.interchange import hf_map
from hpctrain.model import families
from hpctrain.model.families.gpt import GPT
from hpctrain.model.layers import MLP
from hpctrain.model.moe import LocalExchange, MoE
from hpctrain.model.stage import DecoderStage, LocalOps, init_parameters
from hpctrain.planner import flops, memory

ROOT = Path(__file__).resolve().parents[2] / "hpctrain"


def test_config_archs_are_the_registry_names():
    assert ARCHS == families.arch_names()


# model.family as the flags chose it before the key existed (captured from that code): the
# presets, and every combination of arch, experts and the Qwen flags.
INFERRED = {
    "demo.toml": "gpt",
    "gpt/E0/qk0/gate0/bias0": "gpt",
    "gpt/E0/qk0/gate0/bias1": "gpt",
    "gpt/E0/qk0/gate1/bias0": "gpt",
    "gpt/E0/qk0/gate1/bias1": "gpt",
    "gpt/E0/qk1/gate0/bias0": "gpt",
    "gpt/E0/qk1/gate0/bias1": "gpt",
    "gpt/E0/qk1/gate1/bias0": "gpt",
    "gpt/E0/qk1/gate1/bias1": "gpt",
    "gpt/E4/qk0/gate0/bias0": "gpt",
    "gpt/E4/qk0/gate0/bias1": "gpt",
    "gpt/E4/qk0/gate1/bias0": "gpt",
    "gpt/E4/qk0/gate1/bias1": "gpt",
    "gpt/E4/qk1/gate0/bias0": "gpt",
    "gpt/E4/qk1/gate0/bias1": "gpt",
    "gpt/E4/qk1/gate1/bias0": "gpt",
    "gpt/E4/qk1/gate1/bias1": "gpt",
    "llama-1b.toml": "llama",
    "llama-demo.toml": "llama",
    "llama/E0/qk0/gate0/bias0": "llama",
    "llama/E0/qk0/gate0/bias1": "llama",
    "llama/E0/qk0/gate1/bias0": "llama",
    "llama/E0/qk0/gate1/bias1": "llama",
    "llama/E0/qk1/gate0/bias0": "llama",
    "llama/E0/qk1/gate0/bias1": "llama",
    "llama/E0/qk1/gate1/bias0": "llama",
    "llama/E0/qk1/gate1/bias1": "llama",
    "llama/E4/qk0/gate0/bias0": "mixtral",
    "llama/E4/qk0/gate0/bias1": "mixtral",
    "llama/E4/qk0/gate1/bias0": "mixtral",
    "llama/E4/qk0/gate1/bias1": "qwen2_moe",
    "llama/E4/qk1/gate0/bias0": "qwen3_moe",
    "llama/E4/qk1/gate0/bias1": "qwen3_moe",
    "llama/E4/qk1/gate1/bias0": "qwen3_moe",
    "llama/E4/qk1/gate1/bias1": "qwen3_moe",
    "llama3-70b.toml": "llama",
    "llama3-8b.toml": "llama",
    "mixtral-8x7b.toml": "mixtral",
    "tiny-llama.toml": "llama",
    "tiny.toml": "gpt",
}


@pytest.mark.parametrize("case", sorted(INFERRED))
def test_an_older_config_gets_the_family_its_flags_meant(case):
    if case.endswith(".toml"):
        m = load(str(ROOT.parent / "share/configs" / case)).model
    else:
        arch, e, qk, gate, bias = case.split("/")
        m = ModelConfig(arch=arch, num_experts=int(e[1:]), qk_norm=qk == "qk1",
                        shared_expert_gate=gate == "gate1", qkv_bias=bias == "bias1")
    assert m.family == "" and families.family_of(m).name == INFERRED[case]
    settled = families.resolved(m)
    assert settled.family == INFERRED[case]  # recorded: read by name from then on
    assert families.family_of(settled) is families.family_of(m)


def test_the_family_is_chosen_by_name_and_checked():
    m = ModelConfig(arch="llama", num_experts=4, family="qwen3_moe", qk_norm=True)
    assert families.family_of(m).name == "qwen3_moe"
    assert families.family_of(replace(m, family="", qk_norm=False)).name == "mixtral"
    cfg = Config(model=ModelConfig(family="llama", num_experts=4, arch="llama", n_heads=4,
                                   n_kv_heads=4, d_model=32),
                 train=TrainConfig(seq_len=8, global_batch_size=1))
    assert any("model.family='llama' is a family without experts" in p for p in problems(cfg, 1))
    bad = Config(model=ModelConfig(family="mamba"), train=TrainConfig(global_batch_size=1))
    assert any("model.family='mamba'; valid: '', gpt, llama" in p for p in problems(bad, 1))


def test_gpt_attention_ignores_kv_heads_it_cannot_have():
    """gpt has multi-head attention: its kv heads are n_heads whatever n_kv_heads says (the
    checks refuse such a config; the layers do not depend on that)."""
    m = ModelConfig(n_heads=4, n_kv_heads=2)
    assert families.family_of(m).kv_heads(m) == 4
    assert families.family_of(replace(m, arch="llama")).kv_heads(m) == 2


def test_only_the_registry_tests_the_arch():
    pattern = re.compile(r"arch *(==|!=|in) ")
    registry = ROOT / "model" / "families" / "__init__.py"
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(ROOT.rglob("*.py")) if p != registry
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found


# -- a sixth family, registered inside the test (docs/design.md, "A model family") -------
class ReluGPT(GPT):
    """gpt with a ReLU MLP, selected by ``model.family = "relu-gpt"``."""

    name = "relu-gpt"

    def activation(self, x):
        return F.relu(x)


@pytest.fixture
def relu_gpt(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (ReluGPT(),))
    return ModelConfig(family="relu-gpt", n_layers=2, d_model=32, n_heads=4, d_ff=48,
                       vocab_size=64, dtype="float64")


def test_a_new_family_builds_its_stage(relu_gpt):
    assert families.family_of(relu_gpt).name == "relu-gpt"
    assert "relu-gpt" in families.names()
    mlp = MLP(relu_gpt, LocalOps(), torch.float64, 0.02)
    init_parameters([mlp], 1)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    assert torch.equal(mlp(x), F.relu(x @ mlp.w1.T) @ mlp.w2.T)
    stage = DecoderStage(relu_gpt, range(2), True, True)
    init_parameters([stage], 1)
    idx = torch.randint(0, 64, (2, 8))
    assert torch.isfinite(stage(idx, idx))
    moe_cfg = replace(relu_gpt, num_experts=2)
    moe = MoE(moe_cfg, LocalOps(), LocalExchange(), torch.float64, 0.02)
    init_parameters([moe], 1)
    rows = torch.randn(5, 32, dtype=torch.float64)
    assert torch.equal(moe.experts_local(rows, [5, 0]), F.relu(rows @ moe.w1[0].T) @ moe.w2[0].T)


def test_a_new_family_counts_its_flops_and_parameters(relu_gpt):
    stage = DecoderStage(relu_gpt, range(2), True, True)
    init_parameters([stage], 1)
    B, T = 2, 8
    idx = torch.randint(0, 64, (B, T))
    with FlopCounterMode(display=False) as fc:
        stage(idx, idx).backward()
    # the CPU attention kernel is invisible to the counter: add its QK^T and AV (fwd + bwd)
    core = 3 * relu_gpt.n_layers * 2 * 2 * B * T * T * relu_gpt.d_model
    assert fc.get_total_flops() + core == pytest.approx(
        flops.train_flops_per_token(relu_gpt, T, causal=False) * B * T)
    cfg = Config(model=relu_gpt, topology=TopologyConfig(), train=TrainConfig(seq_len=T))
    assert memory.stage_params(cfg, 2, True, True) == sum(p.numel() for p in stage.parameters())


def test_a_new_family_runs_its_checks(relu_gpt):
    def cfg(**kw):
        return Config(model=replace(relu_gpt, **kw), topology=TopologyConfig(),
                      train=TrainConfig(seq_len=8, global_batch_size=1))

    assert problems(cfg(), 1) == []
    assert any("model.n_kv_heads=2 needs" in p for p in problems(cfg(n_kv_heads=2), 1))
    with pytest.raises(hf_map.InterchangeError, match="relu-gpt"):
        hf_map.check_exportable(relu_gpt)
