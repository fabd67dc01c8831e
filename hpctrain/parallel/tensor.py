"""Tensor parallelism (Megatron-style) with optional sequence parallelism.

The model (``hpctrain.model.stage``) already sizes its weights by ``tp_size``: attention is split
by heads (wq/wk/wv column-parallel, wo row-parallel), the MLP on its hidden dimension (w1
column-, w2 row-parallel), embedding and head by vocabulary rows. It calls ``enter_tp`` before
a column-parallel matmul and ``exit_tp`` after a row-parallel one. This module supplies those
two conjugate operations as autograd functions over ``tp_comm`` and the vocab-parallel
cross-entropy:

=====================  ============================  ============================
                       forward                       backward
=====================  ============================  ============================
enter_tp (no SP)  f    identity                      all-reduce
exit_tp  (no SP)  g    all-reduce                    identity
enter_tp (SP)          all-gather along T (dim 1)    reduce-scatter along T
exit_tp  (SP)          reduce-scatter along T        all-gather along T
=====================  ============================  ============================

With sequence parallelism the residual stream between blocks is ``(B, T/tp, C)``: norms and
residual adds run on a slice of the sequence (their weights get partial gradients, summed
over tp by the gradient sync's ``reduce`` in ``parallel/grad_sync/``, via
``ParamMeta.sp_partial``). The embedding output passes through ``exit_tp`` (its vocab-partial
sums become sequence slices) and the head through ``enter_tp``.

Every collective here goes through ``comm.Group`` (axis ``"tp"``), so its time lands in
the run's ``comm.Recorder`` and in ``metrics.jsonl`` under ``comm_s["tp"]``.
"""

from __future__ import annotations

import torch

from .. import comm

_LOW_PRECISION = (torch.bfloat16, torch.float16)


# -- sequence-dimension collectives (B, T, C) <-> (B, T/tp, C) ------------------------------
def _gather_seq(group: comm.Group, x: torch.Tensor) -> torch.Tensor:
    """(B, T/tp, C) on each rank -> (B, T, C), rank r's slice at rows [r*T/tp, (r+1)*T/tp).
    Collective over ``group``."""
    if group.size == 1:
        return x
    local = x.transpose(0, 1).contiguous()  # (T/tp, B, C): comm concatenates along dim 0
    out = local.new_empty((local.shape[0] * group.size, *local.shape[1:]))
    group.allgather(local, out)  # (T, B, C)
    return out.transpose(0, 1).contiguous()


def _scatter_seq(group: comm.Group, x: torch.Tensor) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) slice of their sum.
    Collective over ``group``."""
    if group.size == 1:
        return x
    T = x.shape[1]
    if T % group.size:
        raise ValueError(f"sequence length {T} is not divisible by tp={group.size}")
    full = x.transpose(0, 1).contiguous()  # (T, B, C)
    out = full.new_empty((T // group.size, *full.shape[1:]))
    group.reduce_scatter(full, out)  # (T/tp, B, C)
    return out.transpose(0, 1).contiguous()


def _allreduce(group: comm.Group, x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ``group`` in a new tensor (the input is left untouched)."""
    return group.allreduce_(x.contiguous().clone())


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(ctx.group, grad), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (row-parallel partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _allreduce(group, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """SP enter: all-gather along T forward, reduce-scatter along T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(group, x)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(ctx.group, grad), None


class _ScatterSeq(torch.autograd.Function):
    """SP exit: reduce-scatter along T forward, all-gather along T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_seq(group, x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(ctx.group, grad), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of cross-entropy with the vocabulary split over tp.

    ``logits`` (N, V_local) hold columns [vocab_start, vocab_start + V_local) of a vocabulary
    of ``vocab_size``; columns at or past ``vocab_size`` are padding and are masked to -inf.
    Two all-reduces of (N,)-sized statistics (max; sum-exp and target logit) replace the
    gather of (N, V) logits. Returns the same scalar on every tp rank; the backward gives
    each rank the gradient of its own columns, ``softmax - onehot``, with no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        in_dtype = logits.dtype
        x = logits.float() if in_dtype in _LOW_PRECISION else logits
        N, V_local = x.shape
        cols = torch.arange(vocab_start, vocab_start + V_local, device=x.device)
        x = x.masked_fill(cols >= vocab_size, float("-inf"))  # (N, V_local), a new tensor
        gmax = x.detach().max(dim=-1).values  # (N,)
        group.allreduce_(gmax, "max")
        x = x - gmax.unsqueeze(1)
        exp = x.exp()  # (N, V_local); 0 in padded columns
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < V_local)  # (N,) targets owned by this rank
        local_t = local_t.clamp(0, max(V_local - 1, 0))
        target_logit = x.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        stats = torch.stack([exp.sum(-1), target_logit], dim=1)  # (N, 2)
        group.allreduce_(stats)
        sum_exp, target_logit = stats[:, 0], stats[:, 1]
        loss = (sum_exp.log() - target_logit).sum()
        exp.div_(sum_exp.unsqueeze(1))  # softmax over the whole vocabulary, local columns
        ctx.save_for_backward(exp, local_t, inside)
        ctx.in_dtype = in_dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()  # (N, V_local)
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= inside.to(g.dtype)
        g.mul_(grad)
        return g.to(ctx.in_dtype), None, None, None, None


class TensorParallelOps:
    """The communicating ``ops`` object the model calls (interface of ``model.LocalOps``).

    ``tp_comm``: the tensor-parallel ``comm.Group``; every method is collective over it and
    must be called in the same order on all its ranks (autograd guarantees this for the
    backward, as each rank runs the same graph).
    """

    def __init__(self, tp_comm: comm.Group, sequence_parallel: bool = False):
        self.group = tp_comm
        self.tp_size = tp_comm.size
        self.tp_rank = tp_comm.rank
        self.sequence_parallel = bool(sequence_parallel)

    def __repr__(self) -> str:
        return (f"TensorParallelOps(tp={self.tp_size}, rank={self.tp_rank}, "
                f"sequence_parallel={self.sequence_parallel})")

    def enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Before a column-parallel matmul: (B, T, C) -> (B, T, C) replicated, or with SP
        (B, T/tp, C) -> (B, T, C)."""
        if self.sequence_parallel:
            return _GatherSeq.apply(x, self.group)
        return _CopyToTP.apply(x, self.group)

    def exit_tp(self, x: torch.Tensor) -> torch.Tensor:
        """After a row-parallel matmul: partial sums (B, T, C) -> their sum (B, T, C), or
        with SP this rank's (B, T/tp, C) slice of it."""
        if self.sequence_parallel:
            return _ScatterSeq.apply(x, self.group)
        return _ReduceFromTP.apply(x, self.group)

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor,
                          vocab_start: int, vocab_size: int) -> torch.Tensor:
        """Vocab-parallel sum of token cross-entropies (see
        :class:`_VocabParallelCrossEntropy`); logits (N, V_local), targets (N,) global ids."""
        return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size,
                                                self.group)
