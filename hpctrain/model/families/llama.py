"""The llama family, with the conventions of Hugging Face's ``LlamaForCausalLM`` so that
weights map 1:1: RMSNorm, rotary position embeddings (``rotate_half`` form), grouped-query
attention (``n_kv_heads``; query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``),
SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (``w1`` gate, ``w3`` up, ``w2`` down), no biases.
``model.family = "llama"``: no experts (with experts: ``mixtral.py``, ``qwen_moe.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import ModelConfig
from .base import Family
from .hf import HFForm

if TYPE_CHECKING:
    import torch


class LlamaForm(HFForm):
    """Hugging Face's ``LlamaForCausalLM``."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def refusal(self, m: ModelConfig) -> str | None:
        for key, what in (("qk_norm", "q/k norms"), ("qkv_bias", "q/k/v biases only")):
            if getattr(m, key):
                return (f"model.{key} = true: Hugging Face's {self.architecture} has no "
                        f"{what}; a dense model with q/k norms exports as Qwen3 "
                        f"(model.family = 'qwen3'), one with q/k/v biases as Qwen2 ('qwen2'); "
                        f"with experts, q/k norms and no shared experts as Qwen3-MoE, q/k/v "
                        f"biases and shared experts as Qwen2-MoE; otherwise export --format "
                        f"safetensors")
        return None

    def names(self, m: ModelConfig, hf: dict | None = None) -> list:
        out = [("embed", "model.embed_tokens.weight", None)]
        for i in range(m.n_layers):
            b, L = f"blocks.{i}.", f"model.layers.{i}."
            out.append((b + "norm1.weight", L + "input_layernorm.weight", None))
            out += self.attention_names(m, b, L)
            out.append((b + "norm2.weight", L + "post_attention_layernorm.weight", None))
            out += self.ffn_names(m, b, L, i)
        out.append(("norm_f.weight", "model.norm.weight", None))
        if not m.tie_embeddings:
            out.append(("head", "lm_head.weight", None))
        return out

    def attention_names(self, m: ModelConfig, b: str, L: str) -> list:
        """The attention tensors of a block (prefix ``b``; HF layer prefix ``L``)."""
        out = [(b + f"attn.w{x}", L + f"self_attn.{x}_proj.weight", None) for x in "qkvo"]
        out += [(b + f"attn.b{x}", L + f"self_attn.{x}_proj.bias", None)
                for x in "qkv" if m.qkv_bias]
        return out + [(b + f"attn.{x}_norm.weight", L + f"self_attn.{x}_norm.weight", None)
                      for x in "qk" if m.qk_norm]

    def ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        """The feed-forward tensors of block ``i`` (prefix ``b``; HF layer prefix ``L``)."""
        return [(b + "mlp.w1", L + "mlp.gate_proj.weight", None),
                (b + "mlp.w3", L + "mlp.up_proj.weight", None),
                (b + "mlp.w2", L + "mlp.down_proj.weight", None)]

    def config(self, m: ModelConfig, max_positions: int, dtype: str,
                  special: dict) -> dict:
        n_kv = getattr(m, "n_kv_heads", 0) or m.n_heads
        theta = float(getattr(m, "rope_theta", 10000.0))
        out = {"architectures": [self.architecture], "model_type": self.model_type,
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
        out.update(self.config_extra(m))
        return out

    def config_extra(self, m: ModelConfig) -> dict:
        """The config.json fields only this family's HF class has."""
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}

    def import_refusal(self, hf: dict) -> str | None:
        rope = hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if hf.get("rope_scaling") or rope_type != "default":
            return (f"rope scaling ({hf.get('rope_scaling') or rope}) is not supported: "
                    f"hpctrain has plain rotary positions only")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                return f"{key} = true is not supported: hpctrain's llama blocks have no biases"
        if hf.get("sliding_window") not in (None, 0) and hf.get("use_sliding_window", True):
            return (f"sliding_window = {hf['sliding_window']} is not supported: hpctrain "
                    f"attends to the whole causal prefix")
        if hf.get("hidden_act", "silu") != "silu":
            return f"hidden_act = {hf['hidden_act']!r} is not supported (silu)"
        if (hf.get("pretraining_tp") or 1) != 1:
            return "pretraining_tp != 1 is not supported"
        return self.head_dim_refusal(hf)

    def head_dim_refusal(self, hf: dict) -> str | None:
        """Why the config's ``head_dim`` cannot be imported (None: it can)."""
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim")
        if head_dim not in (None, hidden // heads) or hidden % heads:
            return (f"head_dim = {head_dim} with hidden_size {hidden} and {heads} heads: "
                    f"hpctrain's llama import needs head_dim = hidden_size / heads")
        return None

    def section(self, hf: dict) -> dict:
        rope = hf.get("rope_parameters") or {}
        return {"arch": self.family.arch, "family": self.family.name,
                "n_layers": int(hf["num_hidden_layers"]),
                "d_model": int(hf["hidden_size"]), "n_heads": int(hf["num_attention_heads"]),
                "n_kv_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
                "d_ff": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"]),
                "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
                "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                "init_std": float(hf.get("initializer_range", 0.02))}


class Llama(Family):
    name = "llama"
    arch = "llama"
    norm = "rmsnorm"
    rotary = True
    grouped_query = True
    gated = True
    experts = False
    HF = LlamaForm

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.silu(x)
