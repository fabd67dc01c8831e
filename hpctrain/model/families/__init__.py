"""The model families and their registry: every module that needs to know what a model's
family does asks :func:`family_of`, never ``model.arch`` or the flags itself.

One module per family, each a :class:`~.base.Family` subclass that owns its layer choices,
FLOP terms, memory terms, config checks and its Hugging Face form (one mapping object,
:class:`~.hf.HFForm`):

- ``gpt.py``: GELU MLP, multi-head attention, no positions;
- ``llama.py``: rotary positions, SwiGLU, grouped-query attention, RMSNorm, no experts;
- ``qwen.py``: the llama form as Hugging Face's dense Qwen3 (q/k norms per head) and Qwen2
  (q/k/v biases), selected by name;
- ``mixtral.py``: the llama form with mixture-of-experts layers;
- ``qwen_moe.py``: the llama form with experts as Hugging Face's Qwen3-MoE (q/k norms per
  head) and Qwen2-MoE (q/k/v biases, a gated shared expert);
- ``deepseek.py``: DeepSeek-V3: multi-head latent attention and DeepSeek-V3's experts.

A config names its family (``model.family``). A config without one (older configs and
checkpoints) gets the family :func:`infer` reads from ``model.arch`` and the flags, once:
``hpctrain train`` and ``import`` record it (:func:`resolved`). Adding a family: its module
and one line in ``FAMILIES``. No MPI; imports only ``config``.
"""

from __future__ import annotations

import dataclasses

from ...config import ModelConfig
from . import deepseek, gpt, llama, mixtral, qwen, qwen_moe
from .base import Family, FlopTerms

__all__ = ["FAMILIES", "Family", "FlopTerms", "arch_names", "by_hf_model_type", "family_of",
           "find", "infer", "names", "resolved"]

FAMILIES: tuple[Family, ...] = (
    gpt.GPT(),
    llama.Llama(),
    qwen.Qwen3(),
    qwen.Qwen2(),
    mixtral.Mixtral(),
    qwen_moe.Qwen3Moe(),
    qwen_moe.Qwen2Moe(),
    deepseek.DeepseekV3(),
)


def names() -> tuple[str, ...]:
    """The families' names, ``model.family``'s values, in registry order."""
    return tuple(f.name for f in FAMILIES)


def arch_names() -> tuple[str, ...]:
    """The ``model.arch`` spellings of the families, in registry order."""
    return tuple(dict.fromkeys(f.arch for f in FAMILIES))


def infer(m: ModelConfig) -> str | None:
    """The family a config without ``model.family`` means: by ``model.arch``, and for llama
    models with experts by their flags (q/k norms: Qwen3-MoE; a gated shared expert with
    q/k/v biases: Qwen2-MoE; else Mixtral). None: an unknown arch."""
    if m.arch not in arch_names():
        return None
    if m.arch != "llama":
        return next(f.name for f in FAMILIES if f.arch == m.arch)
    if m.num_experts == 0:
        return "llama"
    if m.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if m.shared_expert_gate and m.qkv_bias else "mixtral"


def find(m: ModelConfig) -> Family | None:
    """The family of ``m``: ``model.family``, else :func:`infer` (None: no such family)."""
    name = m.family or infer(m)
    return next((f for f in FAMILIES if f.name == name), None)


def family_of(m: ModelConfig) -> Family:
    """The family of ``m``; ValueError when there is none."""
    family = find(m)
    if family is None:
        if m.family:
            raise ValueError(f"model.family={m.family!r}; valid: {', '.join(names())}")
        raise ValueError(f"model.arch={m.arch!r}; valid: {', '.join(arch_names())}")
    return family


def resolved(m: ModelConfig) -> ModelConfig:
    """``m`` with its family named (and ``model.arch`` the family's): what a run records, so
    that it and its checkpoints are read by name from then on."""
    family = family_of(m)
    return dataclasses.replace(m, family=family.name, arch=family.arch)


def by_hf_model_type(model_type) -> Family | None:
    """The family whose Hugging Face ``model_type`` this is (None: none)."""
    return next((f for f in FAMILIES if f.hf.model_type == model_type), None)
