"""Context parallelism: each of the ``cp`` ranks of ``topo.cp_comm`` holds 2 of the ``2*cp``
equal chunks of every sequence, and attention runs as a ring.

**Causal load balancing.** cp rank ``r`` holds chunks ``r`` and ``2cp-1-r`` (``segments``;
``data.context_positions`` gives the sampler the same positions), so every rank has one
early and one late chunk and does the same attention work at every ring step. Its local
positions increase, so attention of its queries to its own keys is plain causal attention.

**Ring attention** (:class:`_RingAttention`). Key/value blocks travel around the ring
(``r`` sends to ``r+1``, receives from ``r-1``); at step ``s`` rank ``r`` holds the block of
rank ``src = r - s``. The transfer of the next block is posted (``isend``/``irecv`` on
``cp_comm``) *before* the current block's attention is computed, so it hides behind it.
With ``c = T/(2cp)`` and ``src != r`` only unmasked work is done, the same amount (c x 2c
or 2c x c) on every rank:

- ``src < r``: all local queries against the early chunk of ``src`` (no mask);
- ``src > r``: the late local chunk of queries against both chunks of ``src`` (no mask);
- ``src = r`` (step 0): all local queries against the local keys, causal.

Partial results are merged with the log-sum-exp rule ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)``. The backward pass recomputes each
block's probabilities from the saved output's ``lse``, sends the key/value blocks around the
ring again and returns each block's key/value gradient around the ring to its owner (one
more hop). Document masks (``data.document_mask``): every rank has the document ids of the
whole window (B, T); a block's mask is "key at or before the query, same document", from the
global positions of the queries' and the keys' chunks (a query with no key of its document
in a block gets nothing from it). Grouped-query attention: blocks travel with ``kv`` heads;
query head ``h`` reads kv head ``h // groups``; the kv gradients of a group's query heads are
summed. 16-bit inputs are computed in float32. Every transfer is a ``comm.Group`` method
(axis ``cp``).
"""

from __future__ import annotations

import math

import torch

from .. import comm

_LOW = (torch.bfloat16, torch.float16)
_KV, _DKV = 1, 2  # tags: key/value blocks, their gradients


def segments(T_local: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """Global positions of this rank's ``T_local = T/cp`` tokens: [(start, n), (start, n)],
    chunks ``cp_rank`` and ``2cp-1-cp_rank`` of length ``T_local/2``."""
    c = T_local // 2
    return [(cp_rank * c, c), ((2 * cp_size - 1 - cp_rank) * c, c)]


class RingContext:
    """The ``context`` object the model's attention calls (``model.layers.Attention``): the
    positions of this rank's tokens and ring attention over ``cp_comm``. Collective over it
    (every cp rank runs the same graph, so the transfers match in order)."""

    def __init__(self, cp_comm: comm.Group):
        self.group = cp_comm
        self.cp_size, self.cp_rank = cp_comm.size, cp_comm.rank

    def __repr__(self) -> str:
        return f"RingContext(cp={self.cp_size}, rank={self.cp_rank})"

    def segments(self, T_local: int) -> list[tuple[int, int]]:
        return segments(T_local, self.cp_size, self.cp_rank)

    def attention(self, q, k, v, groups: int, ids=None) -> torch.Tensor:
        """Causal attention of local queries q (B, H, T/cp, hd) over the whole sequence's
        keys and values, of which this rank holds k, v (B, H/groups, T/cp, hd); with ``ids``
        (B, T), the document id of every position of the window, only inside documents."""
        return _RingAttention.apply(q, k, v, self.group, groups, ids)


# -- one block of attention --------------------------------------------------------------
def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, hd) gradients of repeated kv heads -> (B, H/groups, T, hd), summed."""
    if groups == 1:
        return t
    B, H, T, hd = t.shape
    return t.view(B, H // groups, groups, T, hd).sum(2)


def _columns(rank: int, size: int, c: int, device) -> torch.Tensor:
    """Global positions of ``rank``'s 2c tokens (chunks ``rank`` and ``2 size-1-rank``)."""
    return torch.cat([torch.arange(a, a + n, device=device)
                      for a, n in segments(2 * c, size, rank)])


def _document_mask(ids, rank: int, src: int, size: int, c: int, qs: slice, ks: slice):
    """(B, 1, Tq, Tk) True where ``rank``'s query ``qs`` may see ``src``'s key ``ks``: at or
    before it, in the same document (``ids`` (B, T): the window's document ids)."""
    qpos = _columns(rank, size, c, ids.device)[qs]
    kpos = _columns(src, size, c, ids.device)[ks]
    same = ids[:, qpos].unsqueeze(2) == ids[:, kpos].unsqueeze(1)
    return (same & (kpos.unsqueeze(0) <= qpos.unsqueeze(1))).unsqueeze(1)


def _scores(q, k, groups: int, causal: bool, allowed=None) -> torch.Tensor:
    s = torch.matmul(q, _repeat(k, groups).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if allowed is not None:  # document masks: the block's own mask, causality included
        s = s.masked_fill(~allowed, float("-inf"))
    elif causal:
        Tq, Tk = s.shape[-2:]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q, k, v, groups: int, causal: bool, allowed=None):
    """(out (B, H, Tq, hd), lse (B, H, Tq)) of q against one key/value block; a query that
    ``allowed`` lets see no key gets out 0, lse -inf."""
    s = _scores(q, k, groups, causal, allowed)
    lse = torch.logsumexp(s, dim=-1)
    shift = lse if allowed is None else lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.matmul(torch.exp(s - shift.unsqueeze(-1)), _repeat(v, groups)), lse


def _merge(out, lse, part, part_lse) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part * torch.exp(part_lse - new)
                                                      .unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, groups: int, causal: bool, allowed=None):
    """Gradients (dq, dk, dv) of one block, given the final lse and delta = sum(dout*out)."""
    p = torch.exp(_scores(q, k, groups, causal, allowed) - lse.unsqueeze(-1))  # (B,H,Tq,Tk)
    dv = _fold(torch.matmul(p.transpose(-1, -2), dout), groups)
    dp = torch.matmul(dout, _repeat(v, groups).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) / math.sqrt(q.shape[-1])
    dq = torch.matmul(ds, _repeat(k, groups))
    dk = _fold(torch.matmul(ds.transpose(-1, -2), q), groups)
    return dq, dk, dv


def _plan(step: int, rank: int, size: int, c: int):
    """(query slice, key slice, causal) of ring step ``step`` on ``rank``."""
    src = (rank - step) % size
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _mask(ids, step: int, rank: int, size: int, c: int, qs: slice, ks: slice):
    """The block's document mask at ring step ``step`` (None without ``ids``)."""
    if ids is None:
        return None
    return _document_mask(ids, rank, (rank - step) % size, size, c, qs, ks)


def _post_shift(group: comm.Group, send: torch.Tensor, tag: int):
    """Post the send of ``send`` to the next rank and the receive of the previous rank's
    tensor of the same shape: (handles, receive buffer)."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    buf = torch.empty_like(send)
    return [group.isend(send, nxt, tag), group.irecv(buf, prev, tag)], buf


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over ``group`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, groups, ids=None):
        dtype = q.dtype
        work = torch.float32 if dtype in _LOW else dtype
        q, k, v = q.to(work), k.to(work), v.to(work)
        c = q.shape[2] // 2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # (2, B, kv, T/cp, hd): one message per step
        for step in range(group.size):
            last = step == group.size - 1
            handles, nxt = ([], None) if last else _post_shift(group, kv, _KV)
            qs, ks, causal = _plan(step, group.rank, group.size, c)
            allowed = _mask(ids, step, group.rank, group.size, c, qs, ks)
            part, part_lse = _block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                            groups, causal, allowed)
            _merge(out[:, :, qs], lse[:, :, qs], part, part_lse)
            comm.wait_all(handles)
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.groups, ctx.dtype, ctx.ids = group, groups, dtype, ids
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, groups = ctx.group, ctx.groups
        dout = dout.to(q.dtype).contiguous()
        delta = (dout * out).sum(-1)  # (B, H, T/cp)
        c = q.shape[2] // 2
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        sends, incoming = [], None  # incoming: (handle, buffer) of the next dk/dv sum
        for step in range(group.size):
            last = step == group.size - 1
            handles, nxt = ([], None) if last else _post_shift(group, kv, _KV)
            qs, ks, causal = _plan(step, group.rank, group.size, c)
            allowed = _mask(ctx.ids, step, group.rank, group.size, c, qs, ks)
            dq_part, dk, dv = _block_backward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                              dout[:, :, qs], lse[:, :, qs],
                                              delta[:, :, qs], groups, causal, allowed)
            dq[:, :, qs] += dq_part
            acc = torch.zeros_like(kv)  # this block's dk/dv so far, travelling with it
            acc[0][:, :, ks] += dk
            acc[1][:, :, ks] += dv
            if incoming is not None:  # the sum of the ranks before this one on the ring
                incoming[0].wait()
                acc += incoming[1]
            posted, buf = _post_shift(group, acc, _DKV)
            sends.append(posted[0])
            incoming = (posted[1], buf)
            comm.wait_all(handles)
            kv = nxt
        incoming[0].wait()  # this rank's own block, summed over the whole ring
        comm.wait_all(sends)
        dkv = incoming[1]
        return (dq.to(ctx.dtype), dkv[0].to(ctx.dtype), dkv[1].to(ctx.dtype), None, None,
                None)
