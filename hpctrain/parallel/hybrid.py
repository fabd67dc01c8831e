"""Hybrid context parallelism (Megatron's a2a+p2p): ``cp = u * r`` ranks, Ulysses'
all-to-all inside groups of ``u`` consecutive cp ranks, ring attention across the ``r``
groups (``topology.cp_kind = "hybrid"``, ``topology.cp_ulysses = u``;
``config.cp_factors``, ``topology.context_groups``).

Every cp rank holds the ring's load-balanced chunks (rank ``i``: chunks ``i`` and
``2cp-1-i`` of ``2cp``), so sampler, rotary positions and checkpoints are those of the ring
and of Ulysses. Ulysses group ``j`` (cp ranks ``j u .. j u + u - 1``) holds chunks
``j u .. (j+1) u - 1`` and their mirror images: in units of ``u`` chunks, super-chunks
``j`` and ``2r-1-j`` of ``2r``, the ring's layout at ``r`` ranks. So the all-to-all over
the Ulysses group (q, k, v: ``ulysses.to_heads``) gives each rank ``h/u`` heads of its
group's ``T/r`` tokens in global order, exactly the input ring attention over ``r`` ranks
expects from ring rank ``j``; the ring (``ring_attention._RingAttention``, over the ranks
at the same place of every group) runs with those heads, causal load balancing, document
masks and grouped-query attention as it does alone, and the inverse all-to-all
(``ulysses.to_sequence``) returns all heads of the rank's own tokens. With ``u = cp`` the
hybrid runs Ulysses' attention (one fused attention, no ring), with ``u = 1`` the ring's
(no all-to-all). Query and kv heads split over ``tp * u`` (``checks.rules`` refuses
layouts where they do not divide). Every transfer is a ``comm.Group`` method (axis
``cp``).
"""

from __future__ import annotations

import torch

from .. import comm
from .ring_attention import RingContext, _RingAttention
from .ulysses import UlyssesContext, gathered_positions, to_heads, to_sequence


class HybridContext(UlyssesContext):
    """The ``context`` object the model's attention calls: the ring's positions of this
    rank's tokens over the whole ``cp_comm`` (``RingContext.segments``), attention as
    Ulysses over ``ulysses`` and a ring over ``ring``; with one ring (u = cp) exactly
    Ulysses, with Ulysses groups of one (u = 1) exactly the ring."""

    def __init__(self, cp_comm: comm.Group, ulysses: comm.Group, ring: comm.Group):
        super().__init__(cp_comm)
        self.ulysses, self.ring = ulysses, ring

    def __repr__(self) -> str:
        return (f"HybridContext(cp={self.cp_size}={self.ulysses.size}x{self.ring.size}, "
                f"rank={self.cp_rank})")

    def attention(self, q, k, v, groups: int, ids=None) -> torch.Tensor:
        """Causal attention of local queries q (B, H, T/cp, hd) over the whole sequence,
        of which this rank holds k, v (B, H/groups, T/cp, hd); with ``ids`` (B, T) only
        inside documents. Returns (B, H, T/cp, hd)."""
        u = self.ulysses.size
        if self.ring.size == 1:  # the Ulysses group is all of cp_comm
            return super().attention(q, k, v, groups, ids)
        if u == 1:  # the ring is all of cp_comm
            return RingContext.attention(self, q, k, v, groups, ids)
        pos = gathered_positions(q.shape[2], self.cp_size, q.device, self.ring.rank * u, u)
        inverse = torch.argsort(pos)  # the group's tokens in global order
        q, k, v = (to_heads(t, self.ulysses, inverse) for t in (q, k, v))
        y = _RingAttention.apply(q, k, v, self.ring, groups, ids)
        return to_sequence(y, self.ulysses, torch.argsort(inverse))
