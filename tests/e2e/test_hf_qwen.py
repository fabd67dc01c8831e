"""Qwen interchange through the real CLI (docs/models.md): locally made Qwen3ForCausalLM
(q/k norms, heads narrower than hidden / heads), Qwen2ForCausalLM (q/k/v biases, a tied head),
Qwen3MoeForCausalLM (q/k norms, renormalised top-k) and Qwen2MoeForCausalLM (q/k/v biases, a
gated shared expert, top-k not renormalised, experts every second layer) import with
transformers' logits and export back bit for bit; the dense ones generate transformers' greedy
tokens; the Qwen3 import trains under tp2 x pp2 and the Qwen2-MoE import under tp2 x ep2 like
one rank. Nothing is downloaded: the models are made here."""

import json

import numpy as np
import pytest
import torch
import transformers  # the `hf` extra; scripts/setup.sh installs it

from tests.e2e.test_hf_interchange import (
    HF_SIZES,
    assert_generates_greedy,
    hf_logits,
    own_logits,
    tokens,
)
from tests.launch import assert_same, read_params, rel_err, train_cli

pytestmark = pytest.mark.e2e

QWEN3 = dict(HF_SIZES, initializer_range=0.1, head_dim=6, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
QWEN2 = dict(HF_SIZES, initializer_range=0.1, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=24,
             decoder_sparse_step=2, norm_topk_prob=False)


DENSE3 = dict(HF_SIZES, head_dim=6)
DENSE2 = dict(HF_SIZES, tie_word_embeddings=True)


def saved(directory, model):
    """``model`` with its norm weights moved off 1 and its biases off 0 (transformers
    initialises them so, which would hide a norm or bias swapped or left out), saved to
    ``directory``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def made(factory, seed: int, name: str, model: str, config: str, sizes: dict):
    """A random transformers ``model`` of ``config(**sizes)`` (class names), saved."""
    torch.manual_seed(seed)
    cls, conf = getattr(transformers, model), getattr(transformers, config)
    return saved(factory.mktemp("hf") / name, cls(conf(**sizes)))


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    return made(tmp_path_factory, 3, "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3)


@pytest.fixture(scope="module")
def hf_qwen2(tmp_path_factory):
    return made(tmp_path_factory, 4, "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", QWEN2)


@pytest.fixture(scope="module")
def hf_qwen3_dense(tmp_path_factory):
    return made(tmp_path_factory, 5, "qwen3", "Qwen3ForCausalLM", "Qwen3Config", DENSE3)


@pytest.fixture(scope="module")
def hf_qwen2_dense(tmp_path_factory):
    return made(tmp_path_factory, 6, "qwen2", "Qwen2ForCausalLM", "Qwen2Config", DENSE2)


def model_sets(directory) -> list[str]:
    """``--set`` overrides of the model keys ``import`` derives from ``directory``."""
    from hpctrain.interchange import hf_map

    section = hf_map.model_section(json.loads((directory / "config.json").read_text()))
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in section.items()]


def round_trip(src, tmp_path, cli, seed) -> float:
    """Import ``src``, compare hpctrain's logits with transformers', export back: the same
    tensors bit for bit, which transformers loads with every key used. The logits
    difference."""
    from safetensors.numpy import load_file

    ckpt = tmp_path / "ckpt.h5"
    rc, out, err = cli("import", src, "--out", ckpt)
    assert rc == 0, err
    x = tokens(seed)
    theirs, _ = hf_logits(src, x)
    mine = own_logits(ckpt, x)
    diff = (theirs - mine).abs().max().item()
    assert diff < 1e-5, f"transformers and hpctrain logits differ by {diff:.2e}"
    assert mine.abs().max().item() > 0.1
    back = tmp_path / "back"
    assert cli("export", ckpt, "--format", "hf", "--out", back)[0] == 0
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    again, model = hf_logits(back, x)
    assert type(model).__name__ == json.loads((src / "config.json").read_text())[
        "architectures"][0]
    assert torch.equal(again, theirs)
    return diff


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_dense", "qwen2_dense"])
def test_import_logits_and_export(family, request, tmp_path, cli):
    """Import, logits against transformers (float32, 1e-5), export: the same tensors."""
    diff = round_trip(request.getfixturevalue(f"hf_{family}"), tmp_path, cli, 4)
    print(f"{family} logits difference {diff:.2e}")


def test_qwen2_moe_trains_the_same_on_tp2_ep2(hf_qwen2, tmp_path, cli):
    """The import trains the same on tp2 x dp2 (ep2) from the HF directory (init_from) as on
    one rank from the imported checkpoint (float64, 1e-9): q/k/v biases and the shared
    expert split over tp, routed experts over ep. That run's checkpoint exported gives
    transformers hpctrain's logits."""
    imported = tmp_path / "qwen64.h5"
    assert cli("import", hf_qwen2, "--out", imported, "--dtype", "float64")[0] == 0
    sets = (*model_sets(hf_qwen2), "model.dtype=float64", "train.global_batch_size=8",
            "train.steps=3")
    # one rank's microbatch is the dp ranks' microbatches together: the routing statistics
    # are those of the global microbatch
    ref = train_cli(tmp_path / "one", 1, *sets, "train.micro_batch_size=4",
                    f"checkpoint.resume={imported}")
    run = train_cli(tmp_path / "tp2ep2", 4, *sets, f"checkpoint.init_from={hf_qwen2}",
                    "train.micro_batch_size=2", "topology.tp=2", "topology.dp=2",
                    "topology.ep=2")
    assert_same(run, ref, 1e-9, "Qwen2-MoE init_from on tp2 x ep2 against one rank")
    start = read_params(imported)
    for name, value in start.items():  # trained from the HF weights, not a fresh init
        assert rel_err(run.params[name], value) < 0.1, name
    for name in ("blocks.0.attn.bq", "blocks.1.mlp.shared_gate"):
        assert not np.array_equal(run.params[f"model/{name}"], start[f"model/{name}"]), name
    out = tmp_path / "hf_out"
    ckpt = tmp_path / "tp2ep2" / "checkpoints"
    assert cli("export", ckpt, "--format", "hf", "--out", out, "--dtype", "float32")[0] == 0
    x = tokens(5)
    theirs, _ = hf_logits(out, x)
    mine = own_logits(next(ckpt.glob("step_*.h5")), x)
    diff = (theirs - mine).abs().max().item()
    assert diff < 1e-5, f"transformers and hpctrain logits differ by {diff:.2e}"
    print(f"qwen3 trained on tp2 x pp2, exported: logits difference {diff:.2e}")
    print(f"qwen2 trained on tp2 x ep2, exported: logits difference {diff:.2e}")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_dense_qwen_generates_transformers_greedy_tokens(family, request, cli):
    """``generate`` from the HF directory gives transformers' own greedy tokens."""
    directory = request.getfixturevalue(f"hf_{family}_dense")
    assert_generates_greedy(cli, directory, directory)


def test_qwen3_trains_the_same_on_tp2_pp2(hf_qwen3_dense, tmp_path, cli):
    """The dense Qwen3 import trains the same on tp2 x pp2 from the HF directory
    (init_from) as on one rank from the imported checkpoint (float64, 1e-9): heads split
    over tp, each rank's q/k norms the same. That run exported is a Qwen3ForCausalLM with
    hpctrain's logits."""
    imported = tmp_path / "qwen3_64.h5"
    assert cli("import", hf_qwen3_dense, "--out", imported, "--dtype", "float64")[0] == 0
    sets = (*model_sets(hf_qwen3_dense), "model.dtype=float64", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.steps=3")
    ref = train_cli(tmp_path / "one", 1, *sets, f"checkpoint.resume={imported}")
    run = train_cli(tmp_path / "tp2pp2", 4, *sets, f"checkpoint.init_from={hf_qwen3_dense}",
                    "topology.tp=2", "topology.pp=2")
    assert_same(run, ref, 1e-9, "Qwen3 init_from on tp2 x pp2 against one rank")
    start = read_params(imported)
    for name in ("blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.weight"):
        assert not np.array_equal(run.params[f"model/{name}"], start[f"model/{name}"]), name
    out = tmp_path / "hf_out"
    ckpt = tmp_path / "tp2pp2" / "checkpoints"
    assert cli("export", ckpt, "--format", "hf", "--out", out, "--dtype", "float32")[0] == 0
    x = tokens(6)
    theirs, model = hf_logits(out, x)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    diff = (theirs - own_logits(next(ckpt.glob("step_*.h5")), x)).abs().max().item()
    assert diff < 1e-5, f"transformers and hpctrain logits differ by {diff:.2e}"
    print(f"qwen3 trained on tp2 x pp2, exported: logits difference {diff:.2e}")
