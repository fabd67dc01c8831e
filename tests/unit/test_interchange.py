"""The interchange pieces without MPI: what HF configs are refused, sizes and shards, the
byte-level tokenizer, and generation with the key/value cache (same tokens as without it,
without recomputing the prefix)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.config import ModelConfig
from hpctrain.data import tokenizer
from hpctrain.interchange import generation, hf_export, hf_map

LLAMA_HF = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
            "vocab_size": 256, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}


def test_llama_config_maps_to_model_keys_and_back():
    section = hf_map.model_section(LLAMA_HF)
    assert section["arch"] == "llama" and section["n_kv_heads"] == 4
    assert section["rope_theta"] == 5e5 and section["d_ff"] == 64
    m = ModelConfig(**section)
    back = hf_map.hf_config(m, 64, "float32", {})
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps"):
        assert back[key] == LLAMA_HF[key], key
    assert back["rope_parameters"]["rope_theta"] == 5e5


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "mixtral", "sliding_window": 4096, "num_local_experts": 4,
      "num_experts_per_tok": 2}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 16}, "head_dim"),
])
def test_unsupported_hf_features_are_refused(change, words):
    with pytest.raises(hf_map.InterchangeError, match=words):
        hf_map.model_section({**LLAMA_HF, **change})


def test_export_refuses_what_hf_cannot_load():
    with pytest.raises(hf_map.InterchangeError, match="model.family = 'gpt'"):
        hf_map.check_exportable(ModelConfig())
    llama = dict(arch="llama", num_experts=4, top_k=2)
    with pytest.raises(hf_map.InterchangeError, match="moe_every"):
        hf_map.check_exportable(ModelConfig(**llama, moe_every=2))
    with pytest.raises(hf_map.InterchangeError, match="capacity_factor"):
        hf_map.check_exportable(ModelConfig(**llama, capacity_factor=1.25))


def test_every_parameter_maps_to_hf_once():
    """Each parameter of a llama / Mixtral model is named by the map (experts: one entry per
    expert slice), and every HF key once."""
    for extra in ({}, {"num_experts": 3, "top_k": 2}, {"tie_embeddings": True}):
        m = ModelConfig(arch="llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, **extra)
        names = {n for n, _ in generation.whole_model(m).named_parameters()}
        entries = hf_map.entries(m)
        assert {e.name for e in entries} == names
        assert len({e.key for e in entries}) == len(entries)


@pytest.mark.parametrize("text, n", [("5GB", 5 * 10**9), ("40KB", 40_000), ("1000", 1000),
                                     ("2MiB", 2 << 20), ("1.5MB", 1_500_000)])
def test_sizes(text, n):
    assert hf_export.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "0", "-1GB", "5 parsecs", "GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(hf_map.InterchangeError, match="--max-shard-size"):
        hf_export.parse_size(text)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(4, 400))
def test_shards_keep_order_and_limit(sizes, limit):
    tensors = {f"t{i}": n * 4 for i, n in enumerate(sizes)}
    groups = hf_export.shards(tensors, limit)
    assert [k for g in groups for k in g] == list(tensors)
    for g in groups:
        total = sum(tensors[k] for k in g)
        assert total <= limit or len(g) == 1


def test_byte_level_tokenizer_is_the_identity_on_bytes():
    tok = tokenizer.byte_level().library()
    text = "x = 'é✓'\n\t日本"
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert len({tok.id_to_token(i) for i in range(256)}) == 256


def _llama(seed=0, **extra):
    from hpctrain.model import init_parameters

    m = ModelConfig(arch="llama", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                    dtype="float64", init_std=0.2, **extra)
    model = generation.whole_model(m)
    assert sum(n.endswith("mlp.w3") for n, _ in model.named_parameters()) == 2
    init_parameters([model], seed)
    return model.eval()


@pytest.mark.parametrize("extra", [{}, {"num_experts": 4, "top_k": 2}])
def test_cache_gives_the_tokens_of_full_recomputation(extra):
    model = _llama(**extra)
    prompt = list(b"def f(x):")
    greedy = [generation.generate(model, prompt, 40, 0.0, 0, 0, c) for c in (True, False)]
    assert greedy[0] == greedy[1]
    sampled = [generation.generate(model, prompt, 40, 1.0, 20, 7, c) for c in (True, False)]
    assert sampled[0] == sampled[1]
    assert len(set(sampled[0])) > 3  # a sampled sequence, not one repeated token


def test_cache_does_not_recompute_the_prefix():
    """256 tokens: with the cache the model sees the prompt once and then one token per
    step; without it, the whole sequence every step."""
    model = _llama()
    seen = []
    real = model.logits

    def counting(idx, cache=None):
        seen.append(idx.shape[1])
        return real(idx, cache=cache)

    model.logits = counting
    prompt = list(b"hello")
    generation.generate(model, prompt, 256, 0.0, 0, 0, True)
    assert seen == [len(prompt)] + [1] * 255
    seen.clear()
    generation.generate(model, prompt, 8, 0.0, 0, 0, False)
    assert seen == [len(prompt) + i for i in range(8)]


def test_the_tokenizer_is_found_where_the_data_recorded_it(tmp_path):
    """A tokenizer file named by the lineage, the tokenizer.json a prepared data file
    carries, byte-level data; nothing recorded: None."""
    import json

    import h5py
    import numpy as np

    tok = tokenizer.byte_level().library()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = (tmp_path / "tokenizer.json").read_text()
    lineage = json.dumps({"data": {"tokenizer": "bpe", "tokenizer_path":
                                   str(tmp_path / "tokenizer.json")}})
    assert tokenizer.find(lineage)[0] == str(tmp_path / "tokenizer.json")
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["tokenizer_json"] = np.frombuffer(text.encode(), dtype=np.uint8)
    found, why = tokenizer.find(json.dumps({"data": {"tokenizer": "bpe", "source":
                                                     str(tmp_path / "data.h5")}}))
    assert isinstance(found, tokenizer.TokenizerText) and found == text, why
    assert tokenizer.load(found).library().encode("ab").ids == [97, 98]
    assert tokenizer.find(json.dumps({"data": {"tokenizer": "bytes"}}))[0] == tokenizer.BYTES
    assert tokenizer.find("")[0] is None
    assert tokenizer.find(json.dumps({"data": {"tokenizer": "bpe"}}))[0] is None


def test_init_from_compares_what_keys_mean():
    """n_kv_heads = 0 is n_heads and d_ff = 0 is 4 * d_model: not a different model; a
    different rope base is, and dtype or init are how a run trains, not which model."""
    from hpctrain.interchange.init_from import differences

    a = ModelConfig(arch="llama", n_heads=4, n_kv_heads=0, d_ff=0, d_model=32)
    b = ModelConfig(arch="llama", n_heads=4, n_kv_heads=4, d_ff=128, d_model=32,
                    dtype="float64", init_std=0.1)
    assert differences(a, b) == []
    c = ModelConfig(arch="llama", n_heads=4, n_kv_heads=2, d_model=32, rope_theta=5e5)
    assert differences(a, c) == ["model.n_kv_heads = 4, the source has 2",
                                 "model.rope_theta = 10000.0, the source has 500000.0"]


@pytest.mark.parametrize("tp, ep", [(2, 2), (3, 1), (1, 4)])
def test_init_from_reads_each_ranks_slice_of_sharded_safetensors(tmp_path, tp, ep):
    """What a rank of a tp x ep layout reads from an HF directory (sharded weights, experts
    one tensor each) is exactly its slice of the global tensor."""
    import json

    import numpy as np

    from hpctrain.config import Config
    from hpctrain.interchange.hf_import import HFReader
    from hpctrain.model.stage import local_slice

    m = ModelConfig(arch="llama", n_layers=2, d_model=24, n_heads=6, n_kv_heads=3, d_ff=30,
                    vocab_size=250, num_experts=4, top_k=2)
    model = _llama_like(m)
    arrays = {n: p.detach().numpy() for n, p in model.named_parameters()}
    tensors = hf_export.hf_planned(Config(model=m), hf_export.Arrays(arrays), "float32")
    hf_export.write_weights(tmp_path, tensors, 20_000)
    (tmp_path / "config.json").write_text(json.dumps(hf_map.hf_config(m, 64, "float32", {})))
    reader = HFReader(tmp_path)
    assert len(set(reader.where.values())) > 3
    for name, p in model.named_parameters():
        for r_tp in range(tp):
            for r_ep in range(ep):
                index, extent = local_slice(p.hp, tp, r_tp, ep, r_ep)
                got = reader.slice_of(m, name, index)
                assert got.shape == extent and np.array_equal(got, arrays[name][index]), name


def _llama_like(m):
    from hpctrain.model import init_parameters

    model = generation.whole_model(m)
    init_parameters([model], 3)
    return model


def test_deepseek_v3_export_refuses_what_its_class_cannot_hold():
    """DeepSeek-V3 exports refuse softmax scores, experts in every other block, a gated or
    missing shared expert and dropped tokens, each in one message naming the key."""
    base = dict(family="deepseek_v3", arch="llama", n_heads=4, kv_lora_rank=8, qk_nope_dim=4,
                qk_rope_dim=4, num_experts=4, top_k=2, expert_d_ff=8, shared_experts=1,
                router_score="sigmoid")
    assert hf_map.hf_config(ModelConfig(**base), 64, "float32", {})["n_shared_experts"] == 1
    for change, said in ((dict(router_score="softmax"), "model.router_score = 'softmax'"),
                         (dict(moe_every=2), "model.moe_every = 2"),
                         (dict(shared_expert_gate=True), "model.shared_expert_gate = true"),
                         (dict(shared_experts=0), "shared experts of 0"),
                         (dict(capacity_factor=1.25), "model.capacity_factor = 1.25")):
        with pytest.raises(hf_map.InterchangeError) as e:
            hf_map.hf_config(ModelConfig(**{**base, **change}), 64, "float32", {})
        assert str(e.value).startswith(said) and "DeepseekV3ForCausalLM would compute " \
            "otherwise" in str(e.value), str(e.value)
