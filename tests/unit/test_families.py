"""The model-family seam (``hpctrain/model/families/``): the registry maps every config to
one family, ``config.ARCHS`` spells the registry's names, nothing outside the registry tests
``model.arch``, and a family added inside a test (its class plus one registry entry) builds a
stage, counts its FLOPs and parameters and runs its checks with no other module edited."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.checks.rules import problems
from hpctrain.config import ARCHS, Config, ModelConfig, TopologyConfig, TrainConfig
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


@pytest.mark.parametrize("kw, name", [
    ({}, "gpt"), ({"num_experts": 4}, "gpt"), ({"arch": "llama"}, "llama"),
    ({"arch": "llama", "num_experts": 4}, "mixtral"),
])
def test_every_config_has_one_family(kw, name):
    assert families.family_of(ModelConfig(**kw)).name == name


def test_an_unknown_arch_has_no_family():
    m = ModelConfig(arch="mamba")
    assert families.find(m) is None
    with pytest.raises(ValueError, match="model.arch='mamba'; valid: gpt, llama"):
        families.family_of(m)


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


# -- a fourth family, registered inside the test -------------------------------------------
class ReluGPT(GPT):
    """gpt with a ReLU MLP, selected by ``model.arch = "relu-gpt"``."""

    name = "relu-gpt"
    arch = "relu-gpt"

    def activation(self, x):
        return F.relu(x)


@pytest.fixture
def relu_gpt(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (ReluGPT(),))
    return ModelConfig(arch="relu-gpt", n_layers=2, d_model=32, n_heads=4, d_ff=48,
                       vocab_size=64, dtype="float64")


def test_a_new_family_builds_its_stage(relu_gpt):
    assert families.family_of(relu_gpt).name == "relu-gpt"
    assert "relu-gpt" in families.arch_names()
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
