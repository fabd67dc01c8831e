"""Hugging Face interchange through the real CLI (docs/models.md): ``export --format
hf`` of checkpoints written by multi-rank runs loads in transformers with every key used and
gives hpctrain's logits; ``import`` of a locally made LlamaForCausalLM trains under tp2 x pp2
like one rank, and export(import(x)) is x bit for bit; what cannot map is refused with one
message. Nothing is downloaded: models and tokenizers are made here."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers  # the `hf` extra; scripts/setup.sh installs it

from tests.launch import assert_same, mpirun, read_params, rel_err, train_cli

pytestmark = pytest.mark.e2e

LLAMA = ("model.arch=llama", "model.n_layers=2", "model.n_kv_heads=4",
         "train.global_batch_size=8", "train.micro_batch_size=2")
HF_SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=64, initializer_range=0.1,
                tie_word_embeddings=False)


def hf_logits(directory, tokens, dtype=torch.float32, ignored=()):
    """transformers' logits; every key used (but keys ending in one of ``ignored``), none
    missing or mismatched."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), output_loading_info=True, dtype=dtype)
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", [])
                               if not k.endswith(tuple(ignored))]
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} \
        | ({"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    assert not problems, f"transformers did not use the export exactly: {problems}"
    with torch.no_grad():
        return model.eval()(torch.tensor(tokens)).logits, model


def own_logits(ckpt, tokens, dtype=torch.float32):
    from hpctrain.interchange.generation import load_model

    model, cfg, _ = load_model(ckpt)
    return model.to(dtype).logits(torch.tensor(tokens))[..., :cfg.model.vocab_size]


def assert_generates_greedy(cli, source, hf_dir, tokens=8):
    """``hpctrain generate SOURCE`` (byte ids, temperature 0) prints the tokens
    transformers' ``generate`` makes greedily from the model in ``hf_dir``."""
    rc, out, err = cli("generate", source, "--tokenizer", "bytes", "--prompt", "ab",
                       "--tokens", tokens, "--temperature", 0)
    assert rc == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([list(b"ab")]), max_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)[0, 2:].tolist()
    assert out == "ab" + bytes(ids).decode("utf-8", errors="replace") + "\n", (out, ids)


def tokens(seed=0, batch=2, length=24):
    return np.random.default_rng(seed).integers(0, 256, (batch, length)).tolist()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random LlamaForCausalLM (float32, GQA) saved locally, with a byte-level tokenizer."""
    d = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A random MixtralForCausalLM (4 experts, top 2) saved locally in shards."""
    d = tmp_path_factory.mktemp("hf") / "mixtral"
    torch.manual_seed(1)
    config = transformers.MixtralConfig(**HF_SIZES, num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(config).save_pretrained(d, max_shard_size="100KB")
    return d


def test_import_export_round_trip_is_bit_exact(hf_llama, tmp_path, cli):
    """export(import(x)) reproduces x's tensors bit for bit, and the import verifies."""
    from safetensors.numpy import load_file

    ckpt = tmp_path / "ckpt"
    rc, out, _ = cli("import", hf_llama, "--out", ckpt)
    assert rc == 0 and "checkpoint.init_from" in out
    rc, out, _ = cli("inspect", ckpt, "--verify")
    assert rc == 0 and "verify ok" in out
    assert cli("export", ckpt, "--format", "hf", "--out", tmp_path / "back")[0] == 0
    a, b = load_file(hf_llama / "model.safetensors"), load_file(tmp_path / "back" /
                                                                "model.safetensors")
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key


def test_imported_model_trains_the_same_on_tp2_pp2(hf_llama, tmp_path, cli):
    """The import trains the same on tp2 x pp2 (init_from) as on one rank (resume; float64,
    1e-9); then that run's checkpoint exported (sharded, float32) gives transformers
    hpctrain's logits."""
    imported = tmp_path / "llama64.h5"  # float64 for the 1e-9 comparison of layouts
    assert cli("import", hf_llama, "--out", imported, "--dtype", "float64")[0] == 0
    sets = (*LLAMA, "train.steps=3")
    # one rank resumes the import (a checkpoint at step 0, zero moments); tp2 x pp2 starts
    # from the HF directory itself with init_from (fresh optimizer): the same training
    ref = train_cli(tmp_path / "one", 1, *sets, f"checkpoint.resume={imported}")
    assert f"resumed from {imported}" in (tmp_path / "one" / "train.log").read_text()
    run = train_cli(tmp_path / "tp2pp2", 4, *sets, f"checkpoint.init_from={hf_llama}",
                    "model.dtype=float64", "topology.tp=2", "topology.pp=2")
    assert_same(run, ref, 1e-9, "init_from HF dir on tp2 x pp2 against resume on one rank")
    # it started from the HF weights (std 0.1), not a fresh init (std 0.02): three AdamW
    # steps of lr <= 2e-3 leave every tensor close to them
    start = read_params(imported)
    for name, value in start.items():
        assert rel_err(run.params[name], value) < 0.1, name

    # export the tp2 x pp2 run's checkpoint, sharded, and load it in transformers
    ckpt = tmp_path / "tp2pp2" / "checkpoints"
    out = tmp_path / "hf_out"
    assert cli("export", ckpt, "--format", "hf", "--out", out, "--dtype", "float32",
               "--max-shard-size", "40KB")[0] == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).stat().st_size < 80_000 for f in files)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 4
    x = tokens()
    theirs, _ = hf_logits(out, x)
    # hpctrain's forward in float32 on the same float32 weights
    mine = own_logits(next(ckpt.glob("step_*.h5")), x)
    err = (theirs - mine).abs().max().item()
    assert err < 1e-5, f"HF and hpctrain logits differ by {err:.2e}"
    assert mine.abs().max().item() > 0.1  # not trivially small


def test_mixtral_export_from_ep2_run(hf_mixtral, tmp_path, cli):
    """A Mixtral import, trained one step with ep=2 from it (init_from: each rank reads its
    experts), exports as Mixtral (per-expert keys) and transformers computes the same
    logits."""
    from safetensors import safe_open

    start = tmp_path / "start.h5"
    assert cli("import", hf_mixtral, "--out", start)[0] == 0
    run = tmp_path / "moe"
    train_cli(run, 2, *LLAMA, "model.dtype=float32", "model.num_experts=4",
              "model.top_k=2", "topology.dp=2", "topology.ep=2", "train.steps=1",
              f"checkpoint.init_from={start}")
    moved = read_params(next((run / "checkpoints").glob("step_*.h5")))
    first = read_params(start)
    for name, value in first.items():  # one step of lr <= 2e-3 from the imported weights
        assert rel_err(moved[name], value) < 0.05, name
    out = tmp_path / "mixtral"
    assert cli("export", run / "checkpoints", "--format", "hf", "--out", out)[0] == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    x = tokens(1)
    theirs, model = hf_logits(out, x)
    assert type(model).__name__ == "MixtralForCausalLM"
    mine = own_logits(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip(),
                      x)
    err = (theirs - mine).abs().max().item()
    assert err < 1e-5, f"Mixtral and hpctrain logits differ by {err:.2e}"

    # the run's data is byte-level (its lineage says so): the export carries a byte-level
    # tokenizer that transformers uses as is, and generate decodes with it
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("héllo")["input_ids"] == list("héllo".encode())
    rc, text, _ = cli("generate", run / "checkpoints", "--prompt", "def ", "--tokens", 16,
                      "--tokenizer", out, "--temperature", 0)
    assert rc == 0 and text.startswith("def ")
    rc, text, _ = cli("generate", run / "checkpoints", "--tokens", 16, "--benchmark")
    assert rc == 0 and "same tokens: True" in text and "x; same" in text


def test_refusals_are_one_clear_message(hf_llama, tmp_path, cli):
    """What cannot map exits 2 with the reason, no traceback: a gpt-arch checkpoint for
    --format hf; an HF directory with rope scaling; init_from of another model."""
    from hpctrain.config import Config, ModelConfig
    from hpctrain.interchange.hf_import import file_arrays, write_checkpoint
    from hpctrain.model import DecoderStage

    gpt = DecoderStage(ModelConfig(n_layers=1, d_model=16, n_heads=2), [0], True, True)
    arrays = {n: p.detach().numpy() for n, p in gpt.named_parameters()}
    ckpt = write_checkpoint(tmp_path / "gpt.h5", Config(model=gpt.cfg),
                            file_arrays(arrays, "float32"), {})
    rc, _, err = cli("export", ckpt, "--format", "hf", "--out", tmp_path / "x")
    assert rc == 2 and "model.family = 'gpt'" in err, err
    assert not (tmp_path / "x").exists()

    bad = tmp_path / "scaled"
    shutil.copytree(hf_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli("import", bad, "--out", tmp_path / "y.h5")
    assert rc == 2 and "rope scaling" in err
    assert not (tmp_path / "y.h5").exists()

    proc = mpirun(1, ["-m", "hpctrain", "train", "share/configs/tiny.toml", "--run-dir",
                      str(tmp_path / "r"), "--set", "model.arch=llama", "--set",
                      f"checkpoint.init_from={hf_llama}"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "model.n_layers = 8, the source has 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mixtral_import_round_trip_and_logits(hf_mixtral, tmp_path, cli):
    """A locally made MixtralForCausalLM (sharded on save) imports; hpctrain computes its
    logits, and export(import(x)) is x bit for bit."""
    from safetensors.numpy import load_file

    src = hf_mixtral
    assert (src / "model.safetensors.index.json").is_file()
    ckpt = tmp_path / "ckpt.h5"
    assert cli("import", src, "--out", ckpt)[0] == 0
    x = tokens(2)
    theirs, _ = hf_logits(src, x)
    err = (theirs - own_logits(ckpt, x)).abs().max().item()
    assert err < 1e-5, f"Mixtral and hpctrain logits differ by {err:.2e}"
    assert cli("export", ckpt, "--format", "hf", "--out", tmp_path / "back")[0] == 0
    a = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    b = load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_llama2_era_buffers_and_a_tied_head_stored_beside_the_embedding(tmp_path, cli):
    """Llama-2-era checkpoints hold ``rotary_emb.inv_freq`` buffers (derived from rope_theta:
    ignored); a tied model saved with ``lm_head.weight`` is accepted when the head equals the
    embedding and refused, naming both tensors, when it differs."""
    from safetensors.torch import load_file, save_file

    def saved(name, **sizes):
        d = tmp_path / name
        torch.manual_seed(2)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_SIZES, **sizes})) \
            .save_pretrained(d)
        return d, load_file(d / "model.safetensors")

    old, weights = saved("llama2")
    head_dim = HF_SIZES["hidden_size"] // HF_SIZES["num_attention_heads"]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    for i in range(HF_SIZES["num_hidden_layers"]):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    save_file(weights, str(old / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = cli("import", old, "--out", tmp_path / "old.h5")
    assert rc == 0, err
    x = tokens(3)
    theirs = hf_logits(old, x, ignored=("inv_freq",))[0]  # transformers loads it
    assert (theirs - own_logits(tmp_path / "old.h5", x)).abs().max() < 1e-5

    tied, weights = saved("tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = cli("import", tied, "--out", tmp_path / "tied.h5")
    assert rc == 0, err
    theirs = hf_logits(tied, x, ignored=("lm_head.weight",))[0]
    assert (theirs - own_logits(tmp_path / "tied.h5", x)).abs().max() < 1e-5
    weights["lm_head.weight"][0, 0] += 1.0
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = cli("import", tied, "--out", tmp_path / "differs.h5")
    assert rc == 2 and "lm_head.weight" in err and "tie_word_embeddings" in err, err
    assert not (tmp_path / "differs.h5").exists()

