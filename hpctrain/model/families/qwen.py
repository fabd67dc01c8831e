"""The dense Qwen families, in the conventions of Hugging Face's ``Qwen3ForCausalLM`` and
``Qwen2ForCausalLM`` so that weights map 1:1: the llama form (``llama.py``: RMSNorm, rotary
positions, grouped-query attention, SwiGLU) with

- ``qwen3``: RMSNorm over each query and key head before rotary (``model.qk_norm``, its
  epsilon ``model.norm_eps``), no biases, heads of any size (``model.d_head``);
- ``qwen2``: biases on the query, key and value projections (``model.qkv_bias``; none on the
  output projection), heads of any size (HF reads ``head_dim`` when config.json has it).

Selected by name (``model.family = "qwen3"`` or ``"qwen2"``, or an import of the HF class): an
older config without ``model.family`` keeps the family it had (llama). What HF can express and
these families cannot (sliding-window layers, rope scaling, Qwen3's ``attention_bias``, which
also puts a bias on the output projection) is refused on import.
"""

from __future__ import annotations

from ...config import Config, ModelConfig
from .llama import Llama, LlamaForm


def full_attention_refusal(hf: dict) -> str | None:
    """Why an HF Qwen config with sliding-window layers cannot be imported (None: every
    layer attends to the whole causal prefix)."""
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        return (f"layer_types {sorted(kinds)} are not supported: hpctrain attends to the "
                f"whole causal prefix in every layer (full_attention)")
    if hf.get("use_sliding_window"):
        return ("use_sliding_window = true is not supported: hpctrain attends to the whole "
                "causal prefix in every layer")
    return None


def head_size(hf: dict) -> dict:
    """``{"d_head": ...}`` when an HF Qwen config's ``head_dim`` is not hidden / heads (the
    Qwen classes take heads of any size), else nothing."""
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    return {} if head_dim * heads == hidden else {"d_head": head_dim}


class Qwen3Form(LlamaForm):
    """Hugging Face's ``Qwen3ForCausalLM``."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    own = ("qk_norm", "q/k norms")  # the [model] flag the HF class always has
    other = ("qkv_bias", "its attention_bias also puts a bias on the output projection, "
             "which hpctrain has not")

    def refusal(self, m: ModelConfig) -> str | None:
        key, why = self.other
        if getattr(m, key):
            return (f"model.{key} = true: {self.architecture} cannot hold it ({why}); "
                    f"export --format safetensors")
        key, what = self.own
        if not getattr(m, key):
            return (f"model.{key} = false: {self.architecture} always has {what}, so its "
                    f"logits would differ; export --format safetensors")
        return None

    def config_extra(self, m: ModelConfig) -> dict:
        return {"attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": m.n_layers,
                "layer_types": ["full_attention"] * m.n_layers}

    def head_dim_refusal(self, hf: dict) -> str | None:
        return None  # heads of any size: model.d_head

    def import_refusal(self, hf: dict) -> str | None:
        return super().import_refusal(hf) or full_attention_refusal(hf)

    def section(self, hf: dict) -> dict:
        return {**super().section(hf), **head_size(hf), self.own[0]: True}


class Qwen2Form(Qwen3Form):
    """Hugging Face's ``Qwen2ForCausalLM`` (q/k/v biases always, none on o_proj)."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    own = ("qkv_bias", "q/k/v biases")
    other = ("qk_norm", "it has no q/k norms")

    def config_extra(self, m: ModelConfig) -> dict:
        out = super().config_extra(m)
        del out["attention_bias"]
        return out


class Qwen3(Llama):
    """Llama's layers with q/k norms (the flag ``model.qk_norm``); its own Hugging Face
    form."""

    name = "qwen3"
    HF = Qwen3Form

    def check(self, cfg: Config, need) -> None:
        super().check(cfg, need)
        key, what = self.HF.own
        need(getattr(cfg.model, key), f"model.family={self.name!r} has {what}: set "
             f"model.{key} = true (or model.family = 'llama' for a model without them)")


class Qwen2(Qwen3):
    """Llama's layers with q/k/v biases (the flag ``model.qkv_bias``)."""

    name = "qwen2"
    HF = Qwen2Form
