"""What maps to what between an hpctrain ``arch = "llama"`` model and Hugging Face
``LlamaForCausalLM`` / ``MixtralForCausalLM``: config fields and tensor names.

Weights map 1:1 (same rotate-half rope, GQA by repeat, SwiGLU, RMSNorm, no biases), so a
tensor is only renamed; a Mixtral expert tensor is one slice ``[e]`` of hpctrain's stacked
``(E, ...)`` tensor. Everything HF can express that hpctrain cannot (rope scaling, biases,
sliding windows, other model types) is refused with :class:`InterchangeError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig


class InterchangeError(ValueError):
    """A model or directory that cannot be converted; the message says what and why. The CLI
    prints it and exits 2."""


@dataclass(frozen=True)
class Entry:
    """One HF tensor: hpctrain parameter ``name`` (slice ``expert`` of its dim 0 when not
    None) is HF tensor ``key``."""

    name: str
    key: str
    expert: int | None = None


def is_mixtral(m: ModelConfig) -> bool:
    return m.num_experts > 0


def check_exportable(m: ModelConfig) -> None:
    """Refuse models transformers would load as something else (gpt: no rope, GELU), or
    Mixtral-like models whose routing HF cannot express."""
    arch = getattr(m, "arch", "gpt")
    if arch != "llama":
        raise InterchangeError(
            f"model.arch = {arch!r} cannot be exported with --format hf: transformers has no "
            f"architecture with hpctrain's gpt blocks (no rotary positions, GELU MLP); train "
            f"with model.arch = \"llama\", or export --format safetensors")
    if is_mixtral(m) and m.moe_every != 1:
        raise InterchangeError(
            f"model.moe_every = {m.moe_every}: only models where every block is a mixture of "
            f"experts map to Mixtral (moe_every = 1)")
    if is_mixtral(m) and m.capacity_factor > 0:
        raise InterchangeError(
            f"model.capacity_factor = {m.capacity_factor}: Mixtral routes every token "
            f"(dropless); hpctrain would drop tokens, so the logits would differ")


def entries(m: ModelConfig) -> list[Entry]:
    """Every HF tensor of the model, in HF's order."""
    out = [Entry("embed", "model.embed_tokens.weight")]
    for i in range(m.n_layers):
        b, L = f"blocks.{i}.", f"model.layers.{i}."
        out += [Entry(b + "norm1.weight", L + "input_layernorm.weight"),
                Entry(b + "attn.wq", L + "self_attn.q_proj.weight"),
                Entry(b + "attn.wk", L + "self_attn.k_proj.weight"),
                Entry(b + "attn.wv", L + "self_attn.v_proj.weight"),
                Entry(b + "attn.wo", L + "self_attn.o_proj.weight"),
                Entry(b + "norm2.weight", L + "post_attention_layernorm.weight")]
        if is_mixtral(m):
            out.append(Entry(b + "mlp.router", L + "block_sparse_moe.gate.weight"))
            out += [Entry(b + f"mlp.{w}", L + f"block_sparse_moe.experts.{e}.{w}.weight", e)
                    for e in range(m.num_experts) for w in ("w1", "w2", "w3")]
        else:
            out += [Entry(b + "mlp.w1", L + "mlp.gate_proj.weight"),
                    Entry(b + "mlp.w3", L + "mlp.up_proj.weight"),
                    Entry(b + "mlp.w2", L + "mlp.down_proj.weight")]
    out.append(Entry("norm_f.weight", "model.norm.weight"))
    if not m.tie_embeddings:
        out.append(Entry("head", "lm_head.weight"))
    return out


def hf_config(m: ModelConfig, max_positions: int, dtype: str, special: dict) -> dict:
    """config.json for transformers (``special``: bos/eos ids the tokenizer has)."""
    check_exportable(m)
    n_kv = getattr(m, "n_kv_heads", 0) or m.n_heads
    theta = float(getattr(m, "rope_theta", 10000.0))
    out = {"architectures": ["MixtralForCausalLM" if is_mixtral(m) else "LlamaForCausalLM"],
           "model_type": "mixtral" if is_mixtral(m) else "llama",
           "hidden_size": m.d_model, "intermediate_size": m.ffn_dim,
           "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
           "num_key_value_heads": n_kv, "head_dim": m.head_dim, "hidden_act": "silu",
           "rms_norm_eps": m.norm_eps, "rope_theta": theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": theta},
           "vocab_size": m.vocab_size, "max_position_embeddings": max_positions,
           "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
           "initializer_range": m.init_std, "use_cache": True,
           "bos_token_id": special.get("bos"), "eos_token_id": special.get("eos"),
           "pad_token_id": None}
    if is_mixtral(m):
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   router_aux_loss_coef=m.aux_loss_coef, router_jitter_noise=0.0,
                   sliding_window=None, output_router_logits=False)
    else:
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return out


def _refuse_features(hf: dict) -> None:
    kind = hf.get("model_type")
    if kind not in ("llama", "mixtral"):
        raise InterchangeError(f"model_type {kind!r} is not supported: hpctrain imports "
                               f"\"llama\" (LlamaForCausalLM) and \"mixtral\" only")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if hf.get("rope_scaling") or rope_type != "default":
        raise InterchangeError(f"rope scaling ({hf.get('rope_scaling') or rope}) is not "
                               f"supported: hpctrain has plain rotary positions only")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise InterchangeError(f"{key} = true is not supported: hpctrain's llama "
                                   f"blocks have no biases")
    if hf.get("sliding_window") not in (None, 0) and hf.get("use_sliding_window", True):
        raise InterchangeError(f"sliding_window = {hf['sliding_window']} is not supported: "
                               f"hpctrain attends to the whole causal prefix")
    if hf.get("hidden_act", "silu") != "silu":
        raise InterchangeError(f"hidden_act = {hf['hidden_act']!r} is not supported (silu)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim not in (None, hidden // heads) or hidden % heads:
        raise InterchangeError(f"head_dim = {head_dim} with hidden_size {hidden} and "
                               f"{heads} heads: hpctrain needs head_dim = hidden_size / heads")
    if (hf.get("pretraining_tp") or 1) != 1:
        raise InterchangeError("pretraining_tp != 1 is not supported")


def model_section(hf: dict) -> dict:
    """The hpctrain ``[model]`` keys an HF config.json describes (refusing what hpctrain
    cannot express)."""
    try:
        _refuse_features(hf)
        rope = hf.get("rope_parameters") or {}
        out = {"arch": "llama", "n_layers": int(hf["num_hidden_layers"]),
               "d_model": int(hf["hidden_size"]), "n_heads": int(hf["num_attention_heads"]),
               "n_kv_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
               "d_ff": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"]),
               "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
               "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
               "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
               "init_std": float(hf.get("initializer_range", 0.02))}
    except KeyError as e:
        raise InterchangeError(f"config.json has no {e.args[0]!r}") from None
    if hf["model_type"] == "mixtral":
        out.update(num_experts=int(hf["num_local_experts"]),
                   top_k=int(hf["num_experts_per_tok"]), moe_every=1, capacity_factor=0.0)
    return out
