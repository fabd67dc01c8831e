"""The real-size presets (share/configs), the described systems (share/clusters) and the
published Frontier runs (planner/published.py), without MPI."""

from pathlib import Path

import pytest

from hpctrain.__main__ import main
from hpctrain.config import load
from hpctrain.planner import published
from hpctrain.planner.cluster import load as load_cluster
from hpctrain.planner.cost import predict
from hpctrain.planner.memory import stage_params

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "share/configs"
ONE_RANK = ["topology.dp=1", "topology.tp=1", "topology.pp=1", "topology.ep=1",
            "topology.sequence_parallel=false"]

# preset -> (published parameters, layers, d_model, heads, kv heads, d_ff, vocab, tied,
# experts, top_k, rope theta), the numbers of the models' published configs
PRESETS = {
    "llama3-8b": (8_030_261_248, 32, 4096, 32, 8, 14336, 128256, False, 0, 1, 5e5),
    "llama3-70b": (70_553_706_496, 80, 8192, 64, 8, 28672, 128256, False, 0, 1, 5e5),
    "llama-1b": (1_235_814_400, 16, 2048, 32, 8, 8192, 128256, True, 0, 1, 5e5),
    "mixtral-8x7b": (46_702_792_704, 32, 4096, 32, 8, 14336, 32000, False, 8, 2, 1e6),
    "qwen3-8b": (8_190_735_360, 36, 4096, 32, 8, 12288, 151936, False, 0, 1, 1e6),
    "qwen2.5-7b": (7_615_616_512, 28, 3584, 28, 4, 18944, 152064, False, 0, 1, 1e6),
}
# preset -> the cluster and world size its layout is written for
TARGETS = {"llama3-8b": ("dgx-h100", 32), "llama3-70b": ("dgx-h100", 128),
           "llama-1b": ("dgx-h100", 8), "mixtral-8x7b": ("dgx-h100", 64),
           "qwen3-8b": ("dgx-h100", 32), "qwen2.5-7b": ("dgx-h100", 32)}
SYSTEMS = ["frontier-mi250x", "lumi-mi250x", "alps-gh200", "jupiter-gh200", "aurora-pvc",
           "perlmutter-a100"]


def _preset(name, overrides=()):
    return load(str(CONFIGS / f"{name}.toml"), list(overrides))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_has_the_published_shape_and_parameter_count(name):
    total, L, C, H, kv, F, V, tied, E, k, theta = PRESETS[name]
    cfg = _preset(name, ONE_RANK)
    m = cfg.model
    assert (m.arch, m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size) \
        == ("llama", L, C, H, kv, F, V)
    assert (m.tie_embeddings, m.num_experts, m.top_k, m.rope_theta) == (tied, E, k, theta)
    planned = stage_params(cfg, m.n_layers, True, True)  # what plan counts on one rank
    assert abs(planned / total - 1) < 0.001, (planned, total)


@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_accepts_each_preset_on_its_target(name, capsys):
    cluster, world = TARGETS[name]
    assert main(["plan", str(CONFIGS / f"{name}.toml"), "--world-size", str(world),
                 "--cluster", cluster]) == 0
    out = capsys.readouterr().out
    assert f"performance on {cluster}" in out and ": fits" in out, out[-600:]


def test_deepseek_v3_preset_is_transformers_model(capsys):
    """The DeepSeek-V3 preset exported as a config.json builds, in transformers, a model
    (on the meta device) of exactly the parameters plan counts: 671 B without the
    multi-token-prediction layer; plan fits it on its layout (2048 ranks of dgx-h100)."""
    import torch
    import transformers

    from hpctrain.interchange.hf_map import hf_config

    cfg = _preset("deepseek-v3", ONE_RANK)
    hf = hf_config(cfg.model, 4096, "bfloat16", {})
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf))
    total = sum(p.numel() for p in model.parameters())
    assert 671e9 < total < 672e9
    assert stage_params(cfg, cfg.model.n_layers, True, True) == total
    assert main(["plan", str(CONFIGS / "deepseek-v3.toml"), "--world-size", "2048",
                 "--cluster", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert ": fits" in out and "KV cache of generation: 68.6 KiB per token" in out, out[-600:]


@pytest.mark.parametrize("system", SYSTEMS)
def test_each_system_is_described_from_its_sources(system):
    """Every new description names its sources, has a bf16 peak for MFU and plans the ~1B
    preset on one node."""
    c = load_cluster(system)
    text = (ROOT / "share/clusters" / f"{system}.toml").read_text()
    assert c.source and "assumed" in text and c.peak("bfloat16") > 1e14
    rpn = c.ranks_per_node
    cfg = _preset("llama-1b", [f"topology.dp={rpn}", f"train.global_batch_size={8 * rpn}",
                               "train.micro_batch_size=1", "train.seq_len=4096"])
    p = predict(cfg, c)
    assert p.world == rpn and 0 < p.mfu < 1 and p.links["dp"] == "intra"


def test_mi250x_systems_share_the_constant_fitted_to_frontier():
    """Frontier's efficiency is the fit of the three published runs (fitted once, rounded
    to two digits); LUMI has the same GCD and carries it too."""
    runs = [r for r in published.RUNS if r.cluster == "frontier-mi250x"]
    assert [r.name for r in runs] == ["GPT 22B", "GPT 175B", "GPT 1T"]
    fitted = round(published.fitted_efficiency(runs), 2)
    assert load_cluster("frontier-mi250x").efficiency == fitted
    assert load_cluster("lumi-mi250x").efficiency == fitted


def test_frontier_runs_are_the_papers_figures():
    """38.38, 36.14 and 31.96 % of the GCD's 191.5 TFLOP/s; GPT shapes of 22B, 175B, 1T."""
    runs = [r for r in published.RUNS if r.cluster == "frontier-mi250x"]
    peak = load_cluster("frontier-mi250x").peak("float16")
    for run, pct, billions in zip(runs, (38.38, 36.14, 31.96), (22, 175, 1000)):
        assert f"({pct}% of peak)" in run.published
        tflops = float(run.published.split()[0])
        assert abs(100 * tflops * 1e12 / peak - pct) < 0.05
        m = published.config_of(run).model
        n = m.n_layers * 12 * m.d_model ** 2 + 2 * m.vocab_size * m.d_model
        assert abs(n / 1e9 / billions - 1) < 0.04, (run.name, n)


def test_the_docs_sum_up_what_plan_published_prints():
    """docs/planning.md says how many of the runs ``hpctrain plan --published`` prints are
    held (the table itself is the command's output, not copied into the docs)."""
    rows = published.table()
    held = sum(r["run"].held for r in rows)
    doc = (ROOT / "docs/planning.md").read_text()
    assert "plan --published" in doc
    assert f"{held} of the {len(rows)} runs are held within 20 %" in doc
