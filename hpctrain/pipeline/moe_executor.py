"""The runner's handlers for schedules expanded by ``schedule.moe_overlap``.

Forward ``F``: :func:`stage_steps` runs the model's own stepped forward (``DecoderStage.steps``,
``model/steps.py``) to its first exchange request; ``D``/``C`` post the request nonblocking
(``ExpertExchange.post``), ``E``/``G`` wait for it and run on to the next.

When the backward is segmented too (training, a microbatch with no ``W`` on this chunk: every
one of a schedule without ``W``, the whole backwards of ``dualpipev``), the forward graph is
cut at every MoE layer: the layer input ``xs`` and the residual ``h`` become leaves, and so do
the rows each exchange delivers (``got``: dispatched tokens on the experts' rank, ``comb``:
their outputs back home); a forward-only pass (evaluation) cuts nothing. Backward ``B`` then
runs the graph from the stage output down to the last MoE layer's leaves; per MoE layer, last
first: ``CB`` posts the gradient of ``comb`` back to the experts, ``XB`` waits and
back-propagates through the experts (gradient of ``got``), ``DB`` posts that home, ``YB``
waits, back-propagates it into ``xs`` and runs the graph down to the next cut. Every graph
node runs once; parameter gradients accumulate as in one pass.
"""

from __future__ import annotations

import time

import torch

from ..model import RunBlock, RunExperts
from ..model.moe import exchange_of
from ..model.steps import answer
from .actions import Action, deferred, parse
from .moe_overlap import check_ep_order


def stage_steps(stage, x, targets, cuts: list | None, exchange, doc=None):
    """Generator over the stage's own forward (``DecoderStage.steps``) that yields only its
    exchange requests; returns the loss sum or the activations. With ``cuts`` (a list) the
    graph is cut before each MoE layer and the cut recorded; after each block the posted
    exchanges are driven (``exchange.progress``)."""
    if stage.cfg.recompute == "full":
        raise ValueError("schedule.moe_overlap does not support model.recompute")
    return (yield from _relay(stage.steps(x, targets, doc), cuts, exchange))


def _relay(gen, cuts: list | None, exchange):
    """Answer ``gen``'s RunBlock/RunExperts requests by stepping into them; pass its
    Exchange requests up to the schedule's D/C/... actions. Returns ``gen``'s result."""
    return (yield from answer(gen, lambda req: _respond(req, cuts, exchange)))


def _respond(req, cuts: list | None, exchange):
    if isinstance(req, RunBlock):
        if req.block.stepped:
            value = yield from _relay(req.block.steps(req.x, req.doc), cuts, exchange)
        else:
            value = req.call()  # nothing to pause for
        if exchange is not None:  # None: no MoE layer on this rank
            exchange.progress()
        return value
    if isinstance(req, RunExperts):
        h, xs = (req.h, req.xs) if cuts is None else _cut(req, cuts)
        return (h, (yield from _relay(req.layer.steps(xs), cuts, exchange)))
    return (yield req)


def _cut(req: RunExperts, cuts: list):
    """Cut the graph before an MoE layer: ``h`` and ``xs`` go on as fresh leaves."""
    h, xs = req.h.detach().requires_grad_(), req.xs.detach().requires_grad_()
    cuts.append({"h": req.h, "xs": req.xs, "layer": req.layer, "h_leaf": h, "xs_leaf": xs})
    return h, xs


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def backward_steps(cuts: list, out: torch.Tensor, grad, exchange):
    """Generator: the segmented backward of one microbatch (see the module docstring);
    yields exchange requests ``(layer, kind, rows, send_rows, recv_rows)``."""
    roots, grads = [out], [grad]
    for cut in reversed(cuts):
        torch.autograd.backward(roots, grads)  # down to this layer's leaves
        exchange.progress()
        s, r = cut["combine_rows"]  # the combine sent s rows per peer, received r
        g_back = yield (cut["layer"], "combine-grad", _grad(cut["comb"]), r, s)
        torch.autograd.backward(cut["back"], g_back)  # through the experts
        exchange.progress()
        s, r = cut["dispatch_rows"]
        g_rows = yield (cut["layer"], "dispatch-grad", _grad(cut["got"]), r, s)
        torch.autograd.backward(cut["rows"], g_rows)  # into xs
        roots, grads = [cut["h"], cut["xs"]], [_grad(cut["h_leaf"]), _grad(cut["xs_leaf"])]
    torch.autograd.backward(roots, grads)


# -- handlers -----------------------------------------------------------------------------
def _segmented_backward(st, a: Action) -> bool:
    """Whether ``a``'s forward records its cuts for a segmented backward (training, and its
    backward not split into B/W; a forward-only pass keeps nothing)."""
    return st.training and not st.splits(a)


def _states(st) -> dict:
    if not hasattr(st, "moe_steps"):
        st.moe_steps, st.moe_cuts = {}, {}
    return st.moe_steps


def _finish_backward(st, a: Action) -> None:
    key = (a.microbatch, a.c)
    x = st.inputs.get(key)
    if x is not None:
        st.grad_in[key] = x.grad
    st.moe_cuts.pop(key, None)
    st.drop(key)


def _advance(st, a: Action, value=None) -> None:
    """Run microbatch ``a``'s forward or backward generator to its next request or end."""
    skey = (a.microbatch, a.c, a.kind in ("B", "CB", "XB", "DB", "YB"))
    state = _states(st)[skey]
    try:
        state["req"] = state["gen"].send(value)
    except StopIteration as stop:
        del st.moe_steps[skey]
        if skey[2]:
            _finish_backward(st, a)
        else:
            st.forwarded(a, stop.value)


def check_ep_comm(st) -> None:
    """Once per schedule and run: all ranks of ep_comm compare their action lists
    (``moe_overlap.check_ep_order``) before the first collective. Collective over ep_comm."""
    ex = exchange_of(st.chunks)
    if ex is None or ex.group.size == 1 or st.sched in ex.verified:
        return
    texts = ex.group.allgather_obj(st.sched.text(st.rank))
    check_ep_order({r: [parse(x) for x in t.split()] for r, t in enumerate(texts)})
    ex.verified.add(st.sched)


def _forward(st, a: Action) -> None:
    key = (a.microbatch, a.c)
    check_ep_comm(st)
    x, y, *doc = st.microbatches[a.microbatch]  # doc: [document ids and positions] or []
    if st.stage(a) > 0:
        x = st.take("RF", a)
        if st.training:
            st.inputs[key] = x.requires_grad_(True)
    _states(st)
    cuts = st.moe_cuts.setdefault(key, []) if _segmented_backward(st, a) else None
    gen = stage_steps(st.chunks[a.c], x, y if st.is_last(a) else None, cuts,
                      exchange_of(st.chunks), *doc)
    st.moe_steps[(*key, False)] = {"gen": gen}
    _advance(st, a)


def _backward(st, a: Action) -> None:
    if st.splits(a):  # B of a split backward: its exchanges run inside autograd
        return st.plain["B"](st, a)
    key = (a.microbatch, a.c)
    grad = None if st.is_last(a) else st.take("RB", a)
    gen = backward_steps(st.moe_cuts[key], st.outputs[key], grad, exchange_of(st.chunks))
    st.moe_steps[(*key, True)] = {"gen": gen}
    _advance(st, a)


_EXPECT = {"D": "dispatch", "C": "combine", "CB": "combine-grad", "DB": "dispatch-grad"}


def _post(st, a: Action) -> None:
    """D/C/CB/DB: post the requested exchange nonblocking over ep_comm."""
    state = st.moe_steps[(a.microbatch, a.c, a.kind in ("CB", "DB"))]
    layer, kind, rows, send_rows, recv_rows = state["req"]
    if kind != _EXPECT[a.kind]:
        raise RuntimeError(f"action {a}: the microbatch asks for a {kind}, not "
                           f"a {_EXPECT[a.kind]}")
    state["pending"] = layer.exchange.post(rows, send_rows, recv_rows, leaf=not st.splits(a))
    state["sent"] = (rows, send_rows, recv_rows)


def _resume(st, a: Action) -> None:
    """E/G/XB/YB: wait for the posted exchange and compute on to the next one."""
    backward = a.kind in ("XB", "YB")
    state = st.moe_steps[(a.microbatch, a.c, backward)]
    handle, finish = state.pop("pending")
    if handle is not None:
        t0 = time.perf_counter()
        exchange_of(st.chunks).wait(handle)
        st.waited += time.perf_counter() - t0
    got = finish()
    rows, send_rows, recv_rows = state.pop("sent")
    if not backward and _segmented_backward(st, a):  # remember the cut for the backward
        cut = st.moe_cuts[(a.microbatch, a.c)][-1]
        if a.kind == "E":
            cut.update(rows=rows, got=got, dispatch_rows=(send_rows, recv_rows))
        else:
            cut.update(back=rows, comb=got, combine_rows=(send_rows, recv_rows))
    _advance(st, a, got.detach() if backward else got)


HANDLERS = {"F": _forward, "D": _post, "C": _post, "E": _resume, "G": _resume}
BACKWARD_HANDLERS = {"B": _backward, "CB": _post, "DB": _post, "XB": _resume, "YB": _resume}


def handlers_for(sched) -> dict:
    """The handlers an expanded schedule needs: forward segments always; backward segments
    when some backward is whole (a split one keeps its exchanges inside autograd)."""
    whole = any(a.kind == "B" and (a.microbatch, a.c) not in deferred(acts)
                for acts in sched.ranks for a in acts)
    return {**HANDLERS, **BACKWARD_HANDLERS} if whole else HANDLERS
