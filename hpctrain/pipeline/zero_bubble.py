"""Backward split in two for zero-bubble schedules: ``B`` = input gradient, ``W`` = weights.

The model's weight matmuls go through ``model.weight_grad.linear``; the runner arms it for
the whole step of a schedule with ``W`` actions. :func:`input_grad` (``B``) is one ordinary
backward from the stage output (no retained graph) while a ``weight_grad.Pending`` collects:
each weight matmul's backward computes only its input gradient and keeps (input, output
gradient) for later, every other op runs as usual (small parameters such as norm weights, the
embedding and the MoE router get their gradient here). :func:`weight_grad` (``W``) computes
the kept matmuls' weight gradients and accumulates them through autograd's AccumulateGrad,
so ``.grad`` views into flat buffers and post-accumulate hooks (overlapped reductions,
ZeRO-2/3 staging) behave as in one backward. B + W is one backward's work; W reads no
weights (ZeRO-3 gathers nothing for it). The first stage (no differentiable input) splits the
same way: B sends nothing.
"""

from __future__ import annotations

import torch

from ..model.weight_grad import Pending, deferring


def input_grad(out: torch.Tensor, grad, x: torch.Tensor | None):
    """(gradient of ``x`` or None, the ``Pending`` weight matmuls for :func:`weight_grad`).
    ``grad``: gradient of ``out`` (None for a scalar loss). Not collective (model-internal
    tp/ep ops may be)."""
    pending = Pending()
    with deferring(pending):
        torch.autograd.backward(out, grad)
    return (None if x is None else x.grad), pending


def weight_grad(pending: Pending) -> None:
    """Accumulate one microbatch's deferred weight gradients into ``.grad``. Not collective."""
    pending.apply()
