"""Backward split in two for zero-bubble schedules: ``B`` = input gradient, ``W`` = weights.

:func:`input_grad` runs autograd from the stage output to the stage input only, and keeps
the gradients arriving at the graph nodes where the weight paths branch off (the
"intermediates"; PyTorch's pipelining ``stage_backward_input`` finds them). :func:`weight_grad`
later runs autograd from those saved gradients to the weights only, so no op's backward runs
twice. Weights accumulate through autograd's AccumulateGrad, so ``.grad`` views into flat
buffers and post-accumulate hooks (overlapped reductions) behave as in one backward.

Without that (private) PyTorch helper, or on a stage without a differentiable input (the
first), ``B`` computes the input gradient with the graph retained and ``W`` runs the
backward again restricted to the weights: correct, but W then repeats the activation-gradient
work.
"""

from __future__ import annotations

import functools

import torch

_HELPERS: list = []


def _helpers():
    """PyTorch's split-backward helpers, imported on first use: importing
    ``torch.distributed.pipelining`` costs about 1.4 s of CPU per rank (it pulls in dynamo and
    DTensor), which every run would pay at start-up though only zero-bubble schedules need it.
    ``(None, None, None)`` on a PyTorch without them (the retained-graph fallback)."""
    if not _HELPERS:
        try:  # PyTorch >= 2.4
            from torch.autograd.graph import GradientEdge
            from torch.distributed.pipelining._backward import (
                _get_grad_fn_or_grad_acc,
                stage_backward_input,
            )
            _HELPERS.extend([stage_backward_input, _get_grad_fn_or_grad_acc, GradientEdge])
        except ImportError:  # pragma: no cover - older PyTorch
            _HELPERS.extend([None, None, None])
    return _HELPERS


def input_grad(out: torch.Tensor, grad, x: torch.Tensor | None, params: list):
    """(gradient of ``x`` or None, state for :func:`weight_grad`). ``grad``: gradient of
    ``out`` (None for a scalar loss). Not collective (model-internal tp/ep ops may be)."""
    if x is None:  # first stage: nothing to send back, W does the whole backward
        return None, ("retained", out, grad)
    stage_backward_input, grad_node, _ = _helpers()
    if stage_backward_input is None:
        (gx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        return gx, ("retained", out, grad)
    grads = None if grad is None else [grad]
    (gx,), groups = stage_backward_input([out], grads, [x], iter(params))
    covered = {node for g in groups if g.get("grads") is not None for node in g["params"]}
    missing = [p for p in params if grad_node(p) not in covered]
    if missing:
        raise RuntimeError(f"split backward: {len(missing)} parameters of this stage are not "
                           "reached from its input; use schedule.kind='1f1b'")
    return gx, ("groups", groups)


def weight_grad(state, params: list, hold=None) -> None:
    """Accumulate this microbatch's weight gradients into ``.grad`` (AccumulateGrad).
    ``hold`` (ZeRO-3, ``ShardedParams.weight_pass``): called with [(weights, run)], one per
    weight group, it calls every ``run()`` with those weights gathered; a retained-graph W is
    a whole backward, gathered by the module hooks, and ignores it."""
    if state[0] == "retained":
        _, out, grad = state
        torch.autograd.backward(out, grad, inputs=params)
        return
    grad_node = _helpers()[1]
    by_node = {grad_node(p): p for p in params}
    passes = []
    for group in state[1]:
        weights = [by_node[n] for n in group["params"]]
        passes.append((weights, functools.partial(_group_backward, group, weights)))
    if hold is not None:
        hold(passes)
        return
    for _, run in passes:
        run()


def _group_backward(group: dict, weights: list) -> None:
    """One weight group: from the gradients saved at its intermediates to its weights."""
    GradientEdge = _helpers()[2]
    edges, grads, hooks = [], [], []
    for saved, node in zip(group["grads"], group["intermediates"]):
        edges += [GradientEdge(node, i) for i, g in enumerate(saved) if g is not None]
        grads += [g for g in saved if g is not None]
        if len(group["intermediates"]) > 1:  # do not count a descendant's grad twice
            hooks.append(node.register_prehook(lambda _, s=saved: s))
    try:
        torch.autograd.backward(edges, grads, inputs=weights)
    finally:
        for h in hooks:
            h.remove()
