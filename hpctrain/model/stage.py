"""A decoder-only transformer in plain PyTorch, of any model family (``model/families/``
chooses the layers of ``layers.py``; docs/models.md). Imports no MPI.

The model is built as one or more *stages* (contiguous runs of blocks); the first stage owns
the embedding, the last owns the final norm, the head and the loss. Tensor parallelism is
expressed through an ``ops`` object (see :class:`LocalOps`): the model calls
``ops.enter_tp``/``ops.exit_tp`` around its column-/row-parallel matmuls and sizes its
weights by ``ops.tp_size``; ``hpctrain.parallel.tensor`` supplies the communicating version.

Every parameter carries ``p.hp`` (:class:`ParamMeta`): its global shape and how it is split,
which initialisation, checkpointing and the gradient norm use so that any layout holds and
counts exactly the same numbers as one rank.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .families import family_of
from .latent import LatentAttention
from .layers import MLP, NORMS, Attention, KVCache, ParamMeta, Rotary, _param, shard_range
from .mtp import MTPModule, valid_rows, with_objective
from .steps import RunBlock, RunExperts, drive
from .weight_grad import linear

__all__ = ["DTYPES", "Block", "DecoderStage", "KVCache", "LocalOps", "ParamMeta", "init_parameters",
           "local_slice", "param_seed", "shard_range"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class LocalOps:
    """Single-rank stand-in for tensor-parallel communication: all identities."""

    tp_size = 1
    tp_rank = 0
    sequence_parallel = False

    def enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Before a column-parallel matmul (tp: identity fwd / all-reduce bwd)."""
        return x

    def exit_tp(self, x: torch.Tensor) -> torch.Tensor:
        """After a row-parallel matmul (tp: all-reduce fwd / identity bwd)."""
        return x

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor,
                          vocab_start: int, vocab_size: int) -> torch.Tensor:
        """Sum of token cross-entropies; ``logits`` (N, V_local) hold columns
        [vocab_start, vocab_start + V_local) of a vocabulary of ``vocab_size`` (columns past
        it are padding and must not count)."""
        logits = logits[:, :vocab_size]
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # float64 stays float64 (exact comparisons with tp)
        return F.cross_entropy(logits, targets, reduction="sum")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype, ffn: nn.Module | None = None,
                 rotary: Rotary | None = None, context=None):
        super().__init__()
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        sp = ops.sequence_parallel
        family = family_of(cfg)
        norm = NORMS[family.norm]
        self.ops = ops
        self.norm1 = norm(cfg.d_model, cfg.norm_eps, dtype, sp)
        attention = LatentAttention if family.latent_attention else Attention
        self.attn = attention(cfg, ops, dtype, resid_std, rotary, context)
        self.norm2 = norm(cfg.d_model, cfg.norm_eps, dtype, sp)
        self.mlp = ffn if ffn is not None else MLP(cfg, ops, dtype, resid_std)

    @property
    def stepped(self) -> bool:
        """Whether the block can pause (an MoE feed-forward yields at its exchanges)."""
        return self.mlp.stepped

    def steps(self, x, doc=None):  # x: (B, T, C), or (B, T/tp, C) with sequence parallelism
        """The block's forward as a generator (``model/steps.py``): attention, then the
        feed-forward; an MoE feed-forward is requested with :class:`RunExperts`. Returns the
        block's output, shaped like ``x``. ``doc``: document ids and positions (B, 2, T) of
        the whole windows (attention stays inside documents), or None."""
        ops = self.ops
        h = x + ops.exit_tp(self.attn(ops.enter_tp(self.norm1(x)), doc=doc))
        xs = ops.enter_tp(self.norm2(h))  # (B, T, C)
        if self.mlp.stepped:
            h, m = yield RunExperts(self.mlp, h, xs)
        else:
            m = self.mlp(xs)
        return h + ops.exit_tp(m)

    def forward(self, x, doc=None):
        return drive(self.steps(x, doc))

    def decode(self, x, cache: KVCache, layer):
        """Incremental forward of new tokens ``x`` (B, T_new, C) against ``cache`` (one
        process, no sequence parallelism; an MoE feed-forward runs with its blocking
        exchange)."""
        ops = self.ops
        h = x + ops.exit_tp(self.attn(ops.enter_tp(self.norm1(x)), cache, layer))
        return h + ops.exit_tp(self.mlp(ops.enter_tp(self.norm2(h))))


class DecoderStage(nn.Module):
    """Blocks ``layers`` of the model, plus the embedding when ``first`` and the final norm,
    head and loss when ``last``. ``forward(x, targets)`` takes token ids (B, T) on the first
    stage, activations (B, T, C) elsewhere; the last stage returns the *sum* of token
    cross-entropies (the caller scales by the global token count), others the activations.
    With ``model.mtp_depth`` the last stage (also the first: pp = 1) holds the
    multi-token-prediction modules (``mtp.py``), whose blocks follow the main ones in
    ``blocks``, and targets are (B, 1 + D, T) (``data.Sampler`` with ``ahead``).
    ``context`` (``parallel.ring_attention.RingContext``): this rank holds T/cp positions of each
    sequence and attention runs over the cp ring (None: the whole sequence).
    """

    def __init__(self, cfg: ModelConfig, layers, first: bool, last: bool, ops=None,
                 ffn_factory=None, context=None):
        super().__init__()
        ops = ops if ops is not None else LocalOps()
        dtype = DTYPES[cfg.dtype]
        self.cfg, self.ops, self.first, self.last = cfg, ops, first, last
        self.layers = list(layers)
        V, C = cfg.vocab_size, cfg.d_model
        self.vocab_start, _, self.vocab_local = shard_range(V, ops.tp_size, ops.tp_rank)
        vocab_meta = ParamMeta((V, C), tp_dim=0, std=cfg.init_std)
        if first:
            self.embed = _param((self.vocab_local, C), vocab_meta, dtype)
        family = family_of(cfg)
        # One rotary table cache shared by the stage's blocks (a family without positions:
        # none).
        self.rotary = Rotary(family.rotary_dim(cfg), cfg.rope_theta) if family.rotary else None
        mtp = range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth) if last else range(0)
        self.blocks = nn.ModuleDict({
            str(i): Block(cfg, ops, dtype, ffn_factory(i) if ffn_factory else None,
                          self.rotary, context)
            for i in (*self.layers, *mtp)
        })
        if last:
            self.norm_f = NORMS[family.norm](C, cfg.norm_eps, dtype, ops.sequence_parallel)
            if not cfg.tie_embeddings:
                self.head = _param((self.vocab_local, C), vocab_meta, dtype)
            self.mtp = nn.ModuleList(MTPModule(cfg, family.norm, dtype, ops.sequence_parallel)
                                     for _ in mtp)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's range contribute zeros."""
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        if self.ops.tp_size > 1:
            h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ops.exit_tp(h)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies of the final norm and head on x (B, T[/tp], C)."""
        return self._cross_entropy(self.norm_f(x), targets)

    def _cross_entropy(self, normed: torch.Tensor, targets: torch.Tensor, rows=None):
        """The head on ``normed`` (B, T[/tp], C) and the summed cross-entropies against
        ``targets`` (B, T), over the flat positions ``rows`` only when given."""
        h = self.ops.enter_tp(normed)  # (B, T, C)
        # a tied head's weight also gets the embedding's gradient (in B): not deferred
        logits = F.linear(h, self.embed) if self.cfg.tie_embeddings else linear(h, self.head)
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if rows is not None:
            logits, targets = logits.index_select(0, rows), targets.index_select(0, rows)
        return self.ops.cross_entropy_sum(logits, targets, self.vocab_start,
                                          self.cfg.vocab_size)

    def mtp_steps(self, h: torch.Tensor, targets: torch.Tensor, doc=None):
        """Generator: the multi-token-prediction modules on the last block's output ``h``
        against ``targets`` (B, 1 + D, T); returns their summed token cross-entropies."""
        total = None
        for k, module in enumerate(self.mtp, 1):
            tokens = targets[:, k - 1].clamp(min=0)  # the token k after each position
            h = module.project(self.embed_tokens(tokens), h)
            h = yield from self._block(self.blocks[str(self.cfg.n_layers + k - 1)], h, doc)
            t = targets[:, k]
            loss = self._cross_entropy(module.norm(h), t, valid_rows(t))
            total = loss if total is None else total + loss
        return total

    @torch.no_grad()
    def logits(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """(B, T, V_local) next-token logits of a whole model on one rank (generation).

        Without ``cache``: ``idx`` (B, T) is the whole sequence, positions 0..T-1. With a
        :class:`KVCache`: ``idx`` holds only the new tokens, at positions ``cache.length``
        onwards; attention also reads the cached keys and values, and the cache is
        extended by the new tokens (``cache.length`` grows by T)."""
        if cache is None:
            x = drive(self.hidden_steps(idx))
        else:
            x = self.embed_tokens(idx)
            for i in self.layers:
                x = self.blocks[str(i)].decode(x, cache, i)
            cache.length += idx.shape[1]
        w = self.embed if self.cfg.tie_embeddings else self.head
        return F.linear(self.ops.enter_tp(self.norm_f(x)), w)

    def hidden_steps(self, x: torch.Tensor, doc: torch.Tensor | None = None):
        """Generator (``model/steps.py``): the embedding (first stage) and every block, each
        requested with :class:`RunBlock`; returns the activations (B, T, C). With
        ``model.recompute = "full"`` each block runs under activation checkpointing, in one go.
        ``doc``: document ids and positions (B, 2, T) (``data.document_mask``), or None."""
        if self.first:
            x = self.embed_tokens(x)
        for i in self.layers:
            x = yield from self._block(self.blocks[str(i)], x, doc)
        return x

    def _block(self, block: Block, x: torch.Tensor, doc=None):
        """Generator: one block, requested with :class:`RunBlock` (or, with full recompute,
        run in one go under activation checkpointing)."""
        if self.cfg.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(block, *((x,) if doc is None else (x, doc)), use_reentrant=False)
        x = yield RunBlock(block, x, doc)
        return x

    def steps(self, x: torch.Tensor, targets: torch.Tensor | None = None,
              doc: torch.Tensor | None = None):
        """Generator: the stage's forward; returns what :meth:`forward` returns: on the last
        stage the main loss, whose backward also carries the multi-token-prediction loss
        (``mtp.with_objective``) when the targets look ahead."""
        x = yield from self.hidden_steps(x, doc)
        if not self.last:
            return x
        ahead = targets.dim() == 3
        loss = self.head_loss(x, targets[:, 0] if ahead else targets)
        if ahead and len(self.mtp) and torch.is_grad_enabled():
            extra = yield from self.mtp_steps(x, targets, doc)
            loss = with_objective(loss, extra, self.cfg.mtp_loss_weight / len(self.mtp))
        return loss

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                doc: torch.Tensor | None = None):
        return drive(self.steps(x, targets, doc))


def param_seed(seed: int, name: str) -> int:
    """Per-parameter seed: the same global tensor whatever rank or layout creates it."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def local_slice(meta: ParamMeta, tp_size: int, tp_rank: int, ep_size: int = 1,
                ep_rank: int = 0) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """(global index of this rank's real rows, local valid extent) for a parameter."""
    index = [slice(0, n) for n in meta.global_shape]
    for dim, parts, rank in ((meta.tp_dim, tp_size, tp_rank), (meta.expert_dim, ep_size,
                                                                ep_rank)):
        if dim is not None and parts > 1:
            start, stop, _ = shard_range(meta.global_shape[dim], parts, rank)
            index[dim] = slice(start, stop)
    return tuple(index), tuple(s.stop - s.start for s in index)


@torch.no_grad()
def init_parameters(stages, seed: int, tp_size: int = 1, tp_rank: int = 0,
                    ep_size: int = 1, ep_rank: int = 0) -> None:
    """Initialise each parameter by generating its *global* tensor from a per-name seed and
    keeping this rank's slice; padding rows are zero. Layout-independent by construction."""
    for stage in stages:
        for name, p in stage.named_parameters():
            m = p.hp
            if m.init == "ones":
                full = torch.ones(m.global_shape, dtype=torch.float64)
            elif m.init == "zeros":
                full = torch.zeros(m.global_shape, dtype=torch.float64)
            else:
                g = torch.Generator().manual_seed(param_seed(seed, name))
                full = torch.randn(m.global_shape, generator=g, dtype=torch.float64) * m.std
            index, extent = local_slice(m, tp_size, tp_rank, ep_size, ep_rank)
            p.zero_()
            p[tuple(slice(0, n) for n in extent)] = full[index].to(p.dtype)
