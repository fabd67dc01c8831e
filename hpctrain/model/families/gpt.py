"""The gpt family: RMSNorm, multi-head attention without positions, GELU MLP (``w1``,
``w2``); with experts, Switch routing (the top-1 gate is the softmax probability, top-2
gates are renormalised). No Hugging Face form."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import Config
from .base import Family
from .hf import HFForm

if TYPE_CHECKING:
    import torch


class GPTForm(HFForm):
    missing = ("transformers has no architecture with hpctrain's {name} blocks (no rotary "
               "positions, GELU MLP); train with model.family = \"llama\", or export "
               "--format safetensors")


class GPT(Family):
    name = "gpt"
    arch = "gpt"
    norm = "rmsnorm"
    rotary = False
    grouped_query = False
    gated = False
    router_float32 = ("bfloat16",)
    renormalize_top1 = False
    HF = GPTForm

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.gelu(x)

    def check(self, cfg: Config, need) -> None:
        super().check(cfg, need)
        m = cfg.model
        need(m.n_kv_heads in (0, m.n_heads),
             f"model.n_kv_heads={m.n_kv_heads} needs model.family='llama' ({self.name} "
             "attention has as many key/value heads as query heads); set it to 0")
