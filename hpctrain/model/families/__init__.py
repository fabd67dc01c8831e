"""The model families and their registry: every module that needs to know what a model's
family does asks :func:`family_of` (or :func:`find`), never ``model.arch`` itself.

One module per family, each a :class:`~.base.Family` subclass that owns its layer choices,
FLOP terms, memory terms, Hugging Face form and config checks:

- ``gpt.py``: GELU MLP, multi-head attention, no positions (``model.arch = "gpt"``);
- ``llama.py``: rotary positions, SwiGLU, grouped-query attention, RMSNorm
  (``model.arch = "llama"``, no experts);
- ``mixtral.py``: the llama form with mixture-of-experts layers (``model.arch = "llama"``
  with ``num_experts > 0``, no q/k norms, not Qwen2-MoE's features);
- ``qwen_moe.py``: the llama form with experts as Hugging Face's Qwen3-MoE (q/k norms per
  head: ``model.arch = "llama"``, ``num_experts > 0``, ``qk_norm``) and Qwen2-MoE (q/k/v
  biases, a gated shared expert: ``num_experts > 0``, ``shared_expert_gate``, ``qkv_bias``).

A config selects the one family of its ``model.arch`` that claims it
(:meth:`~.base.Family.claims`). Adding a family: its module and one line in ``FAMILIES``
(and its ``model.arch`` spelling in ``config.ARCHS`` when it brings a new one). No MPI;
imports only ``config``.
"""

from __future__ import annotations

from ...config import ModelConfig
from . import gpt, llama, mixtral, qwen_moe
from .base import Family, FlopTerms

__all__ = ["FAMILIES", "Family", "FlopTerms", "arch_names", "by_hf_model_type", "family_of",
           "find"]

FAMILIES: tuple[Family, ...] = (
    gpt.GPT(),
    llama.Llama(),
    mixtral.Mixtral(),
    qwen_moe.Qwen3Moe(),
    qwen_moe.Qwen2Moe(),
)


def arch_names() -> tuple[str, ...]:
    """The ``model.arch`` spellings the families answer to, in registry order."""
    return tuple(dict.fromkeys(f.arch for f in FAMILIES))


def find(m: ModelConfig) -> Family | None:
    """The family of ``m`` (None: no family has its ``model.arch``)."""
    hits = [f for f in FAMILIES if f.arch == m.arch and f.claims(m)]
    if len(hits) > 1:
        raise ValueError(f"model.arch={m.arch!r}: several families claim this model: "
                         f"{', '.join(f.name for f in hits)}")
    return hits[0] if hits else None


def family_of(m: ModelConfig) -> Family:
    """The family of ``m``; ValueError when there is none."""
    family = find(m)
    if family is None:
        raise ValueError(f"model.arch={m.arch!r}; valid: {', '.join(arch_names())}")
    return family


def by_hf_model_type(model_type) -> Family | None:
    """The family whose Hugging Face ``model_type`` this is (None: none)."""
    return next((f for f in FAMILIES if f.hf_model_type == model_type), None)
