"""The layers of a block in plain PyTorch, as the model's family chooses them
(``model/families/``): the norm (:data:`NORMS`), rotary position embeddings
(:class:`Rotary`, ``rotate_half`` form) or none, grouped-query attention (query head ``h``
reads kv head ``h // (n_heads // kv_heads)``) or multi-head, a gated MLP
``w2(act(w1 x) * w3 x)`` or ``w2(act(w1 x))`` with the family's activation. No MPI.

Tensor parallelism comes in through ``ops`` (``stage.LocalOps`` or
``parallel.tensor.TensorParallelOps``): query and kv heads and the MLP's hidden dimension are
split over tp (column-parallel ``wq``/``wk``/``wv``/``w1``/``w3``, row-parallel ``wo``/``w2``).
Context parallelism comes in through ``context`` (``parallel.ring_attention.RingContext``; None: the
whole sequence here): which global positions this rank's tokens hold, and the attention
over keys and values that other ranks hold.
Incremental decoding keeps keys and values in a :class:`KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ARCHS, ModelConfig
from .families import family_of
from .weight_grad import linear

__all__ = ["ARCHS", "KVCache", "MLP", "NORMS", "Attention", "ParamMeta", "RMSNorm", "Rotary",
           "shard_range"]


@dataclass(frozen=True)
class ParamMeta:
    """How this rank's tensor relates to the global parameter.

    ``tp_dim``: dimension split over the tp group (None: replicated over tp).
    ``sp_partial``: replicated over tp, but with sequence parallelism each tp rank sees only
    its part of the sequence, so the gradient must be summed over tp.
    ``expert_dim``: dimension split over the ep group (expert weights), else None.
    ``init``: "normal", "ones" or "zeros"; ``std`` for normal.
    """

    global_shape: tuple[int, ...]
    tp_dim: int | None = None
    sp_partial: bool = False
    expert_dim: int | None = None
    init: str = "normal"
    std: float = 0.02


def shard_range(n: int, parts: int, index: int) -> tuple[int, int, int]:
    """Split length ``n`` into ``parts`` equal padded pieces: (start, stop, local_len).

    ``local_len = ceil(n / parts)``; the last pieces may hold fewer than local_len real
    rows (``stop - start``), the rest being padding that is never read."""
    local = -(-n // parts)
    start = min(index * local, n)
    return start, min(start + local, n), local


def _param(shape, meta: ParamMeta, dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype))
    p.hp = meta
    return p


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding (one process).

    ``k[layer]``/``v[layer]``: (B, kv heads, length, hd) after rotary embedding; ``length``:
    tokens cached, the position of the next token. ``DecoderStage.logits(idx, cache)`` reads
    and extends it: every layer appends its new keys and values, then ``length`` grows."""

    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    length: int = 0

    def extend(self, layer, k: torch.Tensor, v: torch.Tensor):
        """Append this layer's new (B, kv, T_new, hd) keys/values; return all of them."""
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class Rotary:
    """Rotary position embedding tables (HF Llama): ``inv_freq = 1 / theta ** (arange(0, hd,
    2) / hd)``, ``emb = cat(freqs, freqs)``, ``q' = q cos + rotate_half(q) sin``. Tables are
    computed in float64, cast, and cached per (dtype, device), grown to the longest sequence
    asked for; nothing is recomputed per step."""

    def __init__(self, head_dim: int, theta: float):
        self.hd, self.theta = head_dim, theta
        self.tables: dict = {}  # (dtype, device) -> (cos, sin), each (n, hd)

    def cos_sin(self, start: int, n: int, dtype, device):
        key = (dtype, str(device))
        cos, _ = self.tables.get(key, (None, None))
        if cos is None or cos.shape[0] < start + n:
            self._grow(key, start + n, cos, dtype, device)
        cos, sin = self.tables[key]
        return cos[start:start + n], sin[start:start + n]

    @torch.inference_mode(False)  # tables built while generating still serve training
    def _grow(self, key, need: int, cos, dtype, device) -> None:
        length = max(need, 2 * cos.shape[0] if cos is not None else 0)
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64)
                                   / self.hd)
        freqs = torch.outer(torch.arange(length, dtype=torch.float64), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.tables[key] = (emb.cos().to(dtype=dtype, device=device),
                            emb.sin().to(dtype=dtype, device=device))

    def apply(self, x: torch.Tensor, start: int, segments=None) -> torch.Tensor:
        """Rotate ``x`` (B, heads, T, hd; wider: its last hd channels) at global positions
        start .. start+T-1, or with ``segments`` [(start, n), ...] at the concatenation of
        those runs of positions."""
        if segments is None:
            cos, sin = self.cos_sin(start, x.shape[2], x.dtype, x.device)
        else:
            parts = [self.cos_sin(a, n, x.dtype, x.device) for a, n in segments]
            cos, sin = (torch.cat([p[i] for p in parts]) for i in (0, 1))
        return self._rotate(x, cos, sin)

    def at(self, x: torch.Tensor, positions: torch.Tensor, bound: int) -> torch.Tensor:
        """Rotate ``x`` (B, heads, T, hd) at per-sequence positions ``positions`` (B, T),
        each below ``bound`` (document masks: positions restart at each document)."""
        cos, sin = self.cos_sin(0, bound, x.dtype, x.device)
        return self._rotate(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))

    def _rotate(self, x, cos, sin):
        if x.shape[-1] > self.hd:  # latent attention: only the trailing channels rotate
            keep = x.shape[-1] - self.hd
            return torch.cat([x[..., :keep], self._rotate(x[..., keep:], cos, sin)], dim=-1)
        half = self.hd // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def decode_core(q, k, v, start: int) -> torch.Tensor:
    """Attention of new queries q (B, H, T, d) at positions start .. start+T-1 over keys and
    values (B, H, start + T, d) at positions 0 .. start+T-1: query i sees keys 0 .. start + i.
    Returns (B, T, H * v)."""
    B, _, T, _ = q.shape
    if start:
        keys = torch.arange(start + T, device=q.device)
        mask = keys <= torch.arange(start, start + T, device=q.device).unsqueeze(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, sp_partial: bool):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), ParamMeta((dim,), sp_partial=sp_partial, init="ones"),
                             dtype)

    def forward(self, x):
        # 16-bit inputs are normalised in float32: rsqrt's gradient overflows float16.
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


NORMS = {"rmsnorm": RMSNorm}  # a family's ``norm`` -> the layer


class Attention(nn.Module):
    """Causal self-attention, split by heads over tp: wq/wk/wv column-parallel (rows),
    wo row-parallel (columns). The family decides the positions (``rotary``: the given
    rotary tables; else none) and the kv heads (``kv_heads``: grouped-query or as many as
    query heads)."""

    def __init__(self, cfg: ModelConfig, ops, dtype, resid_std: float, rotary=None,
                 context=None):
        super().__init__()
        C, hd, tp = cfg.d_model, cfg.head_dim, ops.tp_size
        family = family_of(cfg)
        kv = family.kv_heads(cfg)
        self.rotary = rotary if family.rotary else None
        self.context = context  # context parallelism (None: the whole sequence is here)
        # selective recompute: the core is replayed in backward (ring attention already
        # recomputes its blocks' probabilities: nothing more to save there)
        self.recompute_core = cfg.recompute == "selective"
        self.heads, self.kv, self.hd = cfg.n_heads // tp, kv // tp, hd
        self.wq = _param((self.heads * hd, C), ParamMeta((cfg.n_heads * hd, C), tp_dim=0,
                                                         std=cfg.init_std), dtype)
        kv_meta = ParamMeta((kv * hd, C), tp_dim=0, std=cfg.init_std)
        self.wk = _param((self.kv * hd, C), kv_meta, dtype)
        self.wv = _param((self.kv * hd, C), kv_meta, dtype)
        self.wo = _param((C, self.heads * hd), ParamMeta((C, cfg.n_heads * hd), tp_dim=1,
                                                         std=resid_std), dtype)
        self.bias = cfg.qkv_bias
        if self.bias:  # split over tp with their projections' rows
            self.bq = _param((self.heads * hd,), ParamMeta((cfg.n_heads * hd,), tp_dim=0,
                                                           init="zeros"), dtype)
            self.bk = _param((self.kv * hd,), ParamMeta((kv * hd,), tp_dim=0, init="zeros"),
                             dtype)
            self.bv = _param((self.kv * hd,), ParamMeta((kv * hd,), tp_dim=0, init="zeros"),
                             dtype)
        # per-head norms: every tp rank holds the whole (hd,) weight and normalises its own
        # heads, so the weight's gradient is a sum over tp
        self.q_norm = RMSNorm(hd, cfg.norm_eps, dtype, tp > 1) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, dtype, tp > 1) if cfg.qk_norm else None

    def forward(self, x, cache: KVCache | None = None, layer=None, doc=None):
        """x: (B, T, C), the full sequence (or, with ``cache``, the new tokens only),
        replicated over tp. Returns this rank's partial sum of the output (B, T, C).
        ``doc`` (B, 2, T): document ids and positions of the whole windows: a query sees
        only keys of its own document, rotary positions are the given ones (None: causal
        over the whole sequence, positions 0..T-1)."""
        q, k, v = self._qkv(x)
        if cache is not None:
            y = self._cached_attention(q, k, v, cache, layer)
        elif self.context is not None:  # this rank's chunks of the sequence
            y = self._context_attention(q, k, v, doc)
        elif self.recompute_core and torch.is_grad_enabled():  # saves q, k, v only
            y = checkpoint(self._core, q, k, v, doc, use_reentrant=False)
        else:
            y = self._core(q, k, v, doc)
        return linear(y, self.wo)  # partial sum over tp: (B, T, C)

    def _qkv(self, x):
        """Queries (B, H_local, T, hd), keys and values (B, kv_local, T, hd) of x (B, T, C),
        before rotary embedding."""
        return (self._heads(x, "q", self.heads, self.q_norm),
                self._heads(x, "k", self.kv, self.k_norm), self._heads(x, "v", self.kv, None))

    def _heads(self, x, which: str, n: int, norm):
        """The projection ``which`` (q, k or v) of x (B, T, C) as (B, n, T, hd): with its
        bias (``model.qkv_bias``), then ``norm`` over each head's channels (``model.qk_norm``),
        before any rotary embedding."""
        B, T, _ = x.shape
        y = linear(x, getattr(self, "w" + which))
        if self.bias:
            y = y + getattr(self, "b" + which)
        y = y.view(B, T, n, self.hd)
        return (y if norm is None else norm(y)).transpose(1, 2)

    def _core(self, q, k, v, doc=None):
        """The attention core, softmax(QK^T)V with positions, over the whole sequence: q
        (B, H_local, T, hd), k/v (B, kv_local, T, hd); causal, or inside documents with
        ``doc``. Returns (B, T, H_local * hd)."""
        if doc is not None:
            return self._document_attention(q, k, v, doc)
        B, _, T, _ = q.shape
        if self.rotary is not None:
            q, k = self.rotary.apply(q, 0), self.rotary.apply(k, 0)
        if self.kv != self.heads:  # HF repeat_kv: query head h reads kv head h // groups
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H_local, T, hd)
        return y.transpose(1, 2).reshape(B, T, -1)

    def _cached_attention(self, q, k, v, cache: KVCache, layer):
        """New queries at positions ``cache.length`` onwards against the cached keys and
        values extended by the new ones. Returns (B, T_new, H_local * hd)."""
        start = cache.length
        if self.rotary is not None:
            q, k = self.rotary.apply(q, start), self.rotary.apply(k, start)
        k, v = cache.extend(layer, k, v)  # (B, kv, start + T, hd)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        return decode_core(q, k, v, start)

    def _document_attention(self, q, k, v, doc):
        """Attention inside documents: q (B, H_local, T, hd), k/v (B, kv_local, T, hd); a
        query sees the keys at or before it with the same document id. (B, T, H_local*hd)."""
        B, _, T, _ = q.shape
        ids, pos = doc[:, 0], doc[:, 1]  # (B, T)
        if self.rotary is not None:
            q, k = self.rotary.at(q, pos, T), self.rotary.at(k, pos, T)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = (ids.unsqueeze(2) == ids.unsqueeze(1)) & causal  # (B, T, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return y.transpose(1, 2).reshape(B, T, -1)

    def _context_attention(self, q, k, v, doc=None):
        """Context parallelism: q (B, H_local, T/cp, hd), k/v (B, kv_local, T/cp, hd) at the
        global positions ``context.segments``; the context attends across the ring (causal,
        grouped-query; with ``doc`` (B, 2, T) inside documents, at their positions) and
        returns (B, T/cp, H_local * hd)."""
        B, _, T, _ = q.shape
        segs = self.context.segments(T)
        if self.rotary is not None and doc is None:
            q, k = self.rotary.apply(q, 0, segs), self.rotary.apply(k, 0, segs)
        elif self.rotary is not None:
            cols = torch.cat([torch.arange(a, a + n, device=q.device) for a, n in segs])
            pos = doc[:, 1][:, cols]  # (B, T/cp): this rank's tokens' document positions
            q, k = self.rotary.at(q, pos, doc.shape[2]), self.rotary.at(k, pos, doc.shape[2])
        ids = None if doc is None else doc[:, 0]
        y = self.context.attention(q, k, v, self.heads // self.kv, ids)  # (B, H_local, T, hd)
        return y.transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    """The dense feed-forward, split on the hidden dimension: ``w2(act(w1 x))``, or gated
    ``w2(act(w1 x) * w3 x)`` (w1 gate, w3 up: column-parallel; w2 down: row-parallel), with
    the family's ``gated`` and ``activation`` (gpt: GELU; llama: SwiGLU)."""

    stepped = False  # runs in one go (an MoE layer yields at its token exchanges)

    def __init__(self, cfg: ModelConfig, ops, dtype, resid_std: float, hidden: int = 0):
        super().__init__()
        C, H = cfg.d_model, hidden or cfg.ffn_dim  # hidden: the shared experts' size
        local = H // ops.tp_size
        self.family = family_of(cfg)
        self.gated = self.family.gated
        self.w1 = _param((local, C), ParamMeta((H, C), tp_dim=0, std=cfg.init_std), dtype)
        if self.gated:
            self.w3 = _param((local, C), ParamMeta((H, C), tp_dim=0, std=cfg.init_std), dtype)
        self.w2 = _param((C, local), ParamMeta((C, H), tp_dim=1, std=resid_std), dtype)

    def forward(self, x):
        act = self.family.activation
        if self.gated:
            return linear(act(linear(x, self.w1)) * linear(x, self.w3), self.w2)
        return linear(act(linear(x, self.w1)), self.w2)
