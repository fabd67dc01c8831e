"""DeepSeek-V3 interchange through the real CLI (docs/models.md): locally made
DeepseekV3ForCausalLM models - one with query compression and DeepSeek's interleaved rotary
rows, one with queries projected directly and rotate-half rows - import with transformers'
logits and export back bit for bit; generation (the latent KV cache) gives transformers'
greedy tokens; the import trains on tp2 x ep2 from the HF directory (init_from, rows
reordered per slice) like one rank. Nothing is downloaded: the models are made here."""

import numpy as np
import pytest
import torch
import transformers  # the `hf` extra; scripts/setup.sh installs it

from tests.e2e.test_hf_interchange import assert_generates_greedy, hf_logits, own_logits, tokens
from tests.e2e.test_hf_qwen import model_sets, round_trip, saved
from tests.launch import assert_same, train_cli

pytestmark = pytest.mark.e2e

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
             topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
             initializer_range=0.1, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def made(factory, name: str, seed: int, **changes):
    """A random DeepseekV3ForCausalLM with its selection biases off 0, saved."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**SIZES, **changes}))
    with torch.no_grad():
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return saved(factory.mktemp("hf") / name, model)


@pytest.fixture(scope="module")
def hf_deepseek(tmp_path_factory):
    return made(tmp_path_factory, "deepseek_v3", 7, q_lora_rank=24, rope_interleave=True)


@pytest.fixture(scope="module")
def hf_deepseek_plain(tmp_path_factory):
    return made(tmp_path_factory, "deepseek_v3_plain", 8, q_lora_rank=None,
                rope_interleave=False, v_head_dim=16, n_group=1, topk_group=1)


def test_import_logits_and_export(hf_deepseek, tmp_path, cli):
    """Import, logits against transformers (float32, 1e-5), export: the same tensors."""
    diff = round_trip(hf_deepseek, tmp_path, cli, 9)
    print(f"deepseek_v3 logits difference {diff:.2e}")


def test_rotate_half_rows_import_and_export_interleaved(hf_deepseek_plain, tmp_path, cli):
    """A model stored with rotate-half rotary rows (``rope_interleave = false``) and no query
    compression imports with transformers' logits; export writes DeepSeek's interleaved
    rows: the rotary rows of q_proj and kv_a_proj_with_mqa are reordered, every other tensor
    is the same, and transformers computes the same logits from it."""
    from safetensors.numpy import load_file

    ckpt, back = tmp_path / "ckpt.h5", tmp_path / "back"
    assert cli("import", hf_deepseek_plain, "--out", ckpt)[0] == 0
    x = tokens(10)
    theirs, _ = hf_logits(hf_deepseek_plain, x)
    assert (theirs - own_logits(ckpt, x)).abs().max().item() < 1e-5
    assert cli("export", ckpt, "--format", "hf", "--out", back)[0] == 0
    a = load_file(hf_deepseek_plain / "model.safetensors")
    b = load_file(back / "model.safetensors")
    moved = sorted(k for k in a if a[k].tobytes() != b[k].tobytes())
    assert moved == sorted(f"model.layers.{i}.self_attn.{p}.weight" for i in range(3)
                           for p in ("kv_a_proj_with_mqa", "q_proj"))
    assert all(sorted(a[k].ravel().tolist()) == sorted(b[k].ravel().tolist()) for k in moved)
    again, model = hf_logits(back, x)
    assert model.config.rope_interleave
    assert (again - theirs).abs().max().item() < 1e-5


def test_generates_transformers_greedy_tokens(hf_deepseek, cli):
    """``generate`` (latent KV cache) gives transformers' own greedy tokens."""
    assert_generates_greedy(cli, hf_deepseek, hf_deepseek)


def test_trains_the_same_on_tp2_ep2(hf_deepseek, tmp_path, cli):
    """The import trains the same on tp2 x dp2 (ep2) from the HF directory (init_from: each
    rank reads its heads' rows, reordered) as on one rank from the imported checkpoint
    (float64, 1e-9); exported, transformers gives hpctrain's logits."""
    imported = tmp_path / "ds64.h5"
    assert cli("import", hf_deepseek, "--out", imported, "--dtype", "float64")[0] == 0
    sets = (*model_sets(hf_deepseek), "model.dtype=float64", "train.global_batch_size=8",
            "train.steps=3")
    ref = train_cli(tmp_path / "one", 1, *sets, "train.micro_batch_size=4",
                    f"checkpoint.resume={imported}")
    run = train_cli(tmp_path / "tp2ep2", 4, *sets, f"checkpoint.init_from={hf_deepseek}",
                    "train.micro_batch_size=2", "topology.tp=2", "topology.dp=2",
                    "topology.ep=2")
    assert_same(run, ref, 1e-9, "DeepSeek-V3 init_from on tp2 x ep2 against one rank")
    bias = run.params["model/blocks.1.mlp.route_bias"]
    assert np.abs(bias).max() > 0.01  # the HF selection bias came in (and moved)
    out = tmp_path / "hf_out"
    ckpt = tmp_path / "tp2ep2" / "checkpoints"
    assert cli("export", ckpt, "--format", "hf", "--out", out, "--dtype", "float32")[0] == 0
    x = tokens(5)
    theirs, _ = hf_logits(out, x)
    diff = (theirs - own_logits(next(ckpt.glob("step_*.h5")), x)).abs().max().item()
    assert diff < 1e-5, f"transformers and hpctrain logits differ by {diff:.2e}"
    print(f"deepseek_v3 trained on tp2 x ep2, exported: logits difference {diff:.2e}")


def test_mtp_layers_export_in_deepseeks_layout_and_come_back(hf_deepseek, tmp_path, cli):
    """A model trained with multi-token prediction exports its module as DeepSeek stores
    it (layer n_layers: the block, enorm, hnorm, eh_proj, shared_head, with copies of the
    embedding and head); transformers, which has no such layer, computes hpctrain's logits
    from the rest; import gives every tensor back bit for bit, the module included."""
    import h5py
    from safetensors.numpy import load_file

    run = train_cli(tmp_path / "mtp", 1, *model_sets(hf_deepseek), "model.mtp_depth=1",
                    "train.steps=1", "train.global_batch_size=2")
    ckpt = next((tmp_path / "mtp" / "checkpoints").glob("step_*.h5"))
    out, back = tmp_path / "hf_mtp", tmp_path / "back.h5"
    assert cli("export", ckpt, "--format", "hf", "--out", out)[0] == 0
    stored = load_file(out / "model.safetensors")
    layer = "model.layers.3."
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
                "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight"):
        assert layer + key in stored, key
    assert np.array_equal(stored[layer + "eh_proj.weight"], run.params["model/mtp.0.eh_proj"])
    x = tokens(11)
    mtp = [layer + "mlp.experts." + k for k in ("gate_up_proj", "down_proj")]  # HF fuses
    theirs, _ = hf_logits(out, x, ignored=(*(k for k in stored if k.startswith(layer)), *mtp))
    assert (theirs - own_logits(ckpt, x)).abs().max().item() < 1e-5
    assert cli("import", out, "--out", back)[0] == 0
    with h5py.File(back) as f, h5py.File(ckpt) as g:
        names = sorted(n for n in g["model"])
        assert sorted(f["model"]) == names and any(n.startswith("mtp.0.") for n in names)
        differ = [n for n in names if not np.array_equal(f["model"][n][...], g["model"][n][...])]
        assert not differ, differ
        assert "mtp_depth = 1" in f.attrs["config"]
