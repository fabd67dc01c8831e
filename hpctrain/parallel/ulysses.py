"""Ulysses context parallelism (DeepSpeed-Ulysses): an all-to-all over ``cp_comm`` swaps
sequence for heads around a plain attention.

Each of the ``cp`` ranks holds the same tokens as under ring attention (chunks ``r`` and
``2cp-1-r`` of the ``2cp`` chunks of every sequence, ``ring_attention.segments``), so the
sampler, rotary positions and checkpoints do not depend on the kind of context
parallelism. For attention, rank ``r`` sends heads ``[j h/cp, (j+1) h/cp)`` of its tokens
to rank ``j`` (one ``alltoallv`` each for q, k and v) and receives its own ``h/cp`` heads of
every rank's tokens; those are put in global sequence order (the chunks of rank ``i`` sit at
``ring_attention.segments(., cp, i)``), plain causal attention runs over the whole
sequence (with document ids, inside documents), and the inverse all-to-all returns every
rank its own tokens for all its heads. Query and key/value heads both split over cp
(``checks.rules`` refuses layouts where they do not divide), so grouped-query attention
keeps its grouping: local query head ``h`` reads local kv head ``h // groups``. The
all-to-all is its own adjoint: the backward pass sends each gradient block back the way
its value came. Every transfer is a ``comm.Group`` method (axis ``cp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from .ring_attention import RingContext, segments


class UlyssesContext(RingContext):
    """The ``context`` object the model's attention calls (``model.layers.Attention``): the
    ring's positions of this rank's tokens (``RingContext.segments``), Ulysses attention
    over ``cp_comm``."""

    def __repr__(self) -> str:
        return f"UlyssesContext(cp={self.cp_size}, rank={self.cp_rank})"

    def attention(self, q, k, v, groups: int, ids=None) -> torch.Tensor:
        """Causal attention of local queries q (B, H, T/cp, hd) over the whole sequence,
        of which this rank holds k, v (B, H/groups, T/cp, hd); with ``ids`` (B, T) only
        inside documents. Returns (B, H, T/cp, hd)."""
        order = gathered_positions(q.shape[2], self.cp_size, q.device)
        inverse = torch.argsort(order)
        q, k, v = (to_heads(t, self.group, inverse) for t in (q, k, v))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            T = q.shape[2]
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            mask = (ids.unsqueeze(2) == ids.unsqueeze(1)) & causal
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return to_sequence(y, self.group, order)


def gathered_positions(T_local: int, cp: int, device=None, first: int = 0,
                       count: int = 0) -> torch.Tensor:
    """Global position of each token of cp ranks ``first .. first+count-1`` (0: all cp
    ranks), ``T_local`` each, gathered in rank order."""
    ranks = range(first, first + (count or cp))
    return torch.cat([torch.arange(a, a + n, device=device)
                      for r in ranks for a, n in segments(T_local, cp, r)])


def to_heads(t: torch.Tensor, group: comm.Group, inverse: torch.Tensor) -> torch.Tensor:
    """(B, h, T/cp, hd) this rank's tokens, all its heads -> (B, h/cp, T, hd) this rank's
    share of the heads, every token in global order (``inverse``: argsort of
    :func:`gathered_positions`)."""
    B, h, Tl, hd = t.shape
    cp = group.size
    send = t.reshape(B, cp, h // cp, Tl, hd).transpose(0, 1)  # block j: heads of rank j
    recv = _Exchange.apply(send, group)  # block i: rank i's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * Tl, hd)[:, :, inverse]


def to_sequence(t: torch.Tensor, group: comm.Group, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_heads`: (B, h/cp, T, hd) -> (B, h, T/cp, hd) (``order``:
    argsort of ``inverse``; the gathered positions themselves when they are all of 0..T-1)."""
    B, hc, T, hd = t.shape
    cp = group.size
    send = t[:, :, order].reshape(B, hc, cp, T // cp, hd).permute(2, 0, 1, 3, 4)
    recv = _Exchange.apply(send, group)  # block j: heads of rank j, this rank's tokens
    return recv.transpose(0, 1).reshape(B, cp * hc, T // cp, hd)


def _exchange(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Block ``j`` of ``x`` (cp, ...) goes to rank ``j``; block ``i`` of the result came
    from rank ``i``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    ones = [1] * group.size
    return group.alltoallv(x, ones, out, ones)


class _Exchange(torch.autograd.Function):
    """The block all-to-all; its adjoint is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    backward = staticmethod(lambda ctx, grad: (_exchange(grad, ctx.group), None))
