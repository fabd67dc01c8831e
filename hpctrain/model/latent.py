"""Multi-head latent attention (DeepSeek-V2/V3, the ``deepseek_v3`` family) in plain PyTorch,
in the conventions of Hugging Face's ``DeepseekV3Attention``. No MPI.

Per token ``x`` (C): the query is ``wq_b(norm(wq_a x))`` (or ``wq x`` with ``model.q_lora_rank
= 0``), ``H`` heads of ``qk_nope_dim + qk_rope_dim`` channels; keys and values come from one
compressed latent ``c = norm((wkv_a x)[:kv_lora_rank])`` and one rotary key
``(wkv_a x)[kv_lora_rank:]`` (``qk_rope_dim`` channels) shared by every head:
``wkv_b c`` holds each head's key part without positions (``qk_nope_dim``) and its value
(``v_head_dim``); a head's key is that part followed by the shared rotary key. Rotary
embeddings (rotate-half form) turn the last ``qk_rope_dim`` channels of queries and keys;
the scale is ``1 / sqrt(qk_nope_dim + qk_rope_dim)``. Both latent norms use epsilon 1e-6 as
Hugging Face's do. The KV cache of decoding holds the latent and the rotated rotary key,
``kv_lora_rank + qk_rope_dim`` numbers per token and layer, and expands them every step.

Tensor parallelism splits the heads (``wq_b``/``wq``, ``wkv_b`` column-parallel, ``wo``
row-parallel, as Megatron-Core does). The down projections and their norms are replicated:
every tp rank computes them, and their gradients - like the input's - hold only this rank's
heads' part, so they are summed over tp (``ParamMeta.sp_partial``; the block's ``enter_tp``
sums the input's). Context parallelism reuses :class:`~.layers.Attention`'s paths; the values
are padded with zeros to the key width there (the ring sends keys and values as one tensor),
so it needs ``v_head_dim <= qk_nope_dim + qk_rope_dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .layers import Attention, KVCache, ParamMeta, RMSNorm, _param, decode_core
from .weight_grad import linear

LATENT_EPS = 1e-6  # the latent norms' epsilon (Hugging Face's DeepseekV3RMSNorm default)


class LatentAttention(Attention):
    """Causal multi-head latent attention, split by heads over tp (module docstring)."""

    def __init__(self, cfg: ModelConfig, ops, dtype, resid_std: float, rotary=None,
                 context=None):
        torch.nn.Module.__init__(self)
        C, tp, H = cfg.d_model, ops.tp_size, cfg.n_heads
        self.rotary, self.context = rotary, context
        self.recompute_core = cfg.recompute == "selective"
        self.heads = self.kv = H // tp
        self.nope, self.rope, self.vd = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.value_dim
        self.hd = self.nope + self.rope  # query/key channels per head
        self.latent = cfg.kv_lora_rank
        partial, std = tp > 1, cfg.init_std

        def split(rows_per_head: int, cols: int, dim: int = 0, s: float = std):
            shape = (H * rows_per_head, cols) if dim == 0 else (cols, H * rows_per_head)
            local = (self.heads * rows_per_head, cols) if dim == 0 else \
                (cols, self.heads * rows_per_head)
            return _param(local, ParamMeta(shape, tp_dim=dim, std=s), dtype)

        def replicated(rows: int, cols: int):
            return _param((rows, cols), ParamMeta((rows, cols), sp_partial=partial, std=std),
                          dtype)

        self.lora = cfg.q_lora_rank
        if self.lora:
            self.wq_a = replicated(self.lora, C)
            self.q_a_norm = RMSNorm(self.lora, LATENT_EPS, dtype, partial)
            self.wq_b = split(self.hd, self.lora)
        else:
            self.wq = split(self.hd, C)
        self.wkv_a = replicated(self.latent + self.rope, C)
        self.kv_a_norm = RMSNorm(self.latent, LATENT_EPS, dtype, partial)
        self.wkv_b = split(self.nope + self.vd, self.latent)
        self.wo = split(self.vd, C, dim=1, s=resid_std)

    def forward(self, x, cache: KVCache | None = None, layer=None, doc=None):
        """As :meth:`Attention.forward`; with ``cache`` the cache holds latents
        (:meth:`_latent_decode`)."""
        if cache is None:
            return super().forward(x, doc=doc)
        return linear(self._latent_decode(x, cache, layer), self.wo)

    def _queries(self, x):
        """(B, H_local, T, qk) queries of x (B, T, C), before rotary embedding."""
        B, T, _ = x.shape
        q = linear(self.q_a_norm(linear(x, self.wq_a)), self.wq_b) if self.lora else \
            linear(x, self.wq)
        return q.view(B, T, self.heads, self.hd).transpose(1, 2)

    def _latent(self, x):
        """The normalised latent (B, 1, T, kv_lora_rank) and the shared rotary key
        (B, 1, T, qk_rope_dim) of x (B, T, C), before rotary embedding."""
        ckv = linear(x, self.wkv_a).unsqueeze(1)
        return self.kv_a_norm(ckv[..., :self.latent]), ckv[..., self.latent:]

    def _expand(self, c, k_rot):
        """Keys (B, H_local, S, qk) and values (B, H_local, S, v) of latents c (B, 1, S, r)
        and rotary keys (B, 1, S, qk_rope_dim)."""
        B, _, S, _ = c.shape
        kv = linear(c, self.wkv_b).view(B, S, self.heads, self.nope + self.vd).transpose(1, 2)
        k = torch.cat([kv[..., :self.nope], k_rot.expand(B, self.heads, S, self.rope)], -1)
        return k, kv[..., self.nope:]

    def _qkv(self, x):
        return (self._queries(x), *self._expand(*self._latent(x)))

    def _context_attention(self, q, k, v, doc=None):
        """:meth:`Attention._context_attention` with the values padded to the key width."""
        B, _, T, vd = v.shape
        y = super()._context_attention(q, k, F.pad(v, (0, self.hd - vd)), doc)
        return y.view(B, T, self.heads, self.hd)[..., :vd].reshape(B, T, -1)

    def _latent_decode(self, x, cache: KVCache, layer):
        """New queries at positions ``cache.length`` onwards against the cached latents and
        rotary keys extended by the new ones. Returns (B, T_new, H_local * v)."""
        start = cache.length
        q = self.rotary.apply(self._queries(x), start)
        c, k_rot = self._latent(x)
        c, k_rot = cache.extend(layer, c, self.rotary.apply(k_rot, start))
        k, v = self._expand(c, k_rot)  # (B, H_local, start + T, ...)
        return decode_core(q, k, v, start)
