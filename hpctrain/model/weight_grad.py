"""Weight matmuls whose weight gradient can wait: the store behind the zero-bubble B/W split.
No MPI.

Every weight matmul of the model (attention's ``wq``/``wk``/``wv``/``wo`` and the MLP's
``w1``/``w2``/``w3``, tp column- or row-parallel alike, the untied head, the MoE experts'
matmuls) calls :func:`linear`. Outside a split-backward step that is ``F.linear`` itself,
so every other schedule runs exactly the code it ran before. While :func:`armed` (the schedule
runner, for a schedule with ``W`` actions), it is :class:`_Linear`: the weight enters it
detached, and its backward returns the input gradient only and keeps (weight, input, output
gradient) in the :class:`Pending` that collects during that backward (:func:`deferring`,
around ``B``; a backward outside one is an error). ``B`` is then
one ordinary backward from the stage output, minus the weight matmuls; small parameters
(norm weights, the embedding, the MoE router, a tied head) get their gradient in ``B`` as
usual. :meth:`Pending.apply` (``W``) computes ``grad_out^T @ input`` for each kept matmul
and hands the results to autograd at the weights (one engine call from the weights: their
AccumulateGrad), so ``.grad`` views into flat buffers accumulate in place and
post-accumulate-grad hooks (overlapped reduction, ZeRO-2/3 staging) fire once per parameter
and microbatch, as in one backward. W reads no weight, so ZeRO-3 gathers nothing for it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["Pending", "armed", "deferring", "linear"]

# One switch per process (not per thread: autograd runs CUDA backward ops on its own threads).
_ARMED = [False]  # forward: route weight matmuls through _Linear
_SINK: list = [None]  # backward: the Pending that keeps the weight matmuls (None: outside B)

FLUSH_BYTES = 256 * 2**20  # W hands weight gradients to autograd in groups of about this size


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``F.linear`` without bias); ``w`` a parameter or a view of one (an
    expert's slice). While :func:`armed`, its weight gradient waits for ``W``."""
    if not (_ARMED[0] and w.requires_grad and x.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, w)
    # The weight enters detached: autograd gets no edge to it, so B neither computes its
    # gradient nor runs its AccumulateGrad (whose hooks would fire with no gradient).
    return _Linear.apply(x, w.detach(), [w])


class _Linear(torch.autograd.Function):
    """``F.linear(x, w)``; backward: the input gradient only, (weight, input, output
    gradient) into the :class:`Pending` of this ``B``."""

    @staticmethod
    def forward(ctx, x, w, weight):
        ctx.save_for_backward(x, w)
        ctx.weight = weight[0]
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        sink = _SINK[0]
        if sink is None:
            raise RuntimeError("a weight matmul armed for a split backward ran its backward "
                               "outside weight_grad.deferring (its weight gradient would be "
                               "lost)")
        sink.items.append((ctx.weight, x.detach(), grad))
        return grad.matmul(w), None, None


def _weight_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(out, in) = grad^T @ x over all leading dims of x (.., in) and grad (.., out)."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class Pending:
    """The weight matmuls one ``B`` kept: ``items`` = [(weight, input, output gradient)],
    in backward order. Holds the inputs and output gradients until :meth:`apply`."""

    def __init__(self):
        self.items: list = []

    def apply(self) -> None:
        """``W``: accumulate every kept weight gradient into its parameter's ``.grad``
        (autograd from the weights, so AccumulateGrad and its hooks run once per parameter).
        A parameter's slices (experts) go to autograd in the same call. Not collective."""
        by_param: dict = {}  # id(parameter) -> [(weight or view of it, input, grad)]
        for item in self.items:
            w = item[0]
            by_param.setdefault(id(w if w._base is None else w._base), []).append(item)
        self.items = []
        roots, grads, nbytes = [], [], 0
        for group in by_param.values():
            with torch.no_grad():
                for w, x, g in group:
                    roots.append(w)
                    grads.append(_weight_grad(x, g))
                    nbytes += grads[-1].numel() * grads[-1].element_size()
            if nbytes >= FLUSH_BYTES:
                torch.autograd.backward(roots, grads)
                roots, grads, nbytes = [], [], 0
        if roots:
            torch.autograd.backward(roots, grads)


@contextlib.contextmanager
def armed(on: bool = True):
    """While on, :func:`linear` defers its weight gradients: the whole step of a schedule
    that splits the backward (forward, and B, where recompute replays the forward)."""
    before, _ARMED[0] = _ARMED[0], bool(on)
    try:
        yield
    finally:
        _ARMED[0] = before


@contextlib.contextmanager
def deferring(pending: Pending):
    """Around one backward (``B``): the armed matmuls' weight gradients go to ``pending``."""
    before, _SINK[0] = _SINK[0], pending
    try:
        yield pending
    finally:
        _SINK[0] = before
