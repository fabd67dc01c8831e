"""Execute one rank's schedule for one optimizer step.

The schedule (``pipeline.actions``) is a list of actions; :data:`HANDLERS` maps each action
kind to the function that runs it, so a new kind (e.g. expert dispatch ``D``) is one more
entry. Training runs :func:`run_step`; evaluation runs :func:`run_forward`, the same handlers on
the kind's forward-only schedule (``build(..., forward_only=True)``) under ``torch.no_grad()``:
the same peers and tags (``actions.link``), no autograd leaves, an activation dropped once sent.
Transfers go over ``topo.pp_comm`` with nonblocking ``isend``/``irecv``: a receive
(``RF``/``RB``) only *posts* the request into a fresh buffer, the compute that needs the tensor
waits for it; sends are posted right after the compute and completed at the end of the step.
Stage inputs are received buffers turned into autograd leaves (``requires_grad``), so each
stage's graph ends at its boundary; a microbatch's tensors are dropped after its last backward
action, so only in-flight microbatches hold activations.

Zero-bubble schedules split the backward (:func:`input_grad`; ``dualpipev`` only the
microbatches its cool-down gives a ``W``, the others run one whole backward in ``B``): ``B`` is
one ordinary backward from the stage output while a ``weight_grad.Pending`` collects the weight
matmuls (armed per action, ``weight_grad.armed``, for the split microbatches only; each computes
only its input gradient and keeps its input and output gradient), so the small parameters
(norm weights, the embedding, the MoE router) get their gradient in ``B``; ``W`` is
``Pending.apply``: the kept matmuls' weight gradients, accumulated through autograd at the
weights, so ``.grad`` views into flat buffers and post-accumulate hooks (overlapped reductions,
ZeRO-2/3 staging) behave as in one backward. ``W`` reads no weight (ZeRO-3 gathers nothing for
it). The first stage (no differentiable input) splits the same way: its ``B`` sends nothing.

Evidence: every action is a ``timers.action`` span (the tracer sees ``F3``, ``SB2``...);
:func:`run_step` returns this rank's compute seconds per action kind, idle (bubble) seconds
and step seconds (the waits themselves are exposed ``pp`` communication in the run's
``comm.Recorder``), and :func:`pipeline_metrics` turns them into the measured bubble next to
the simulator's value.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter

import torch

from ..config import microbatches as microbatch_count
from ..model import weight_grad
from ..model.moe import set_loss_scale
from ..model.stage import DTYPES
from . import moe_executor, moe_overlap
from .actions import Action, Schedule, deferred
from .placement import activation_shape
from .schedules import build, virtual_stages
from .simulate import simulate


@functools.lru_cache(maxsize=16)
def _schedule(kind: str, pp: int, m: int, v: int, forward_only: bool) -> Schedule:
    return build(kind, pp, m, v, forward_only)


def schedule_for(cfg, m: int, forward_only: bool = False) -> Schedule:
    """The (cached) schedule of this config for ``m`` microbatches per step; with
    ``forward_only`` its evaluation pass (no ``B``/``W``)."""
    return _schedule(cfg.schedule.kind, cfg.topology.pp, m, virtual_stages(cfg), forward_only)


def input_grad(out: torch.Tensor, grad, x: torch.Tensor | None):
    """``B`` of a split backward: (gradient of ``x`` or None, the ``weight_grad.Pending``
    whose ``apply()`` is ``W``). ``grad``: gradient of ``out`` (None for a scalar loss). Not
    collective (model-internal tp/ep ops may be)."""
    pending = weight_grad.Pending()
    with weight_grad.deferring(pending):
        torch.autograd.backward(out, grad)
    return (None if x is None else x.grad), pending


class StepState:
    """Everything one step's handlers share on this rank."""

    def __init__(self, chunks, microbatches, topo, cfg, loss_scale: float, sched: Schedule,
                 sharded=None):
        self.chunks, self.microbatches, self.topo = chunks, microbatches, topo
        self.sharded = sharded  # zero 3: grad_sync.sharded.ShardedParams (around backwards)
        self.loss_scale, self.sched = loss_scale, sched
        self.rank = topo.pp_rank
        self.deferred = deferred(sched.ranks[self.rank])  # (mb, chunk) whose B is split
        self.split = bool(self.deferred)
        self.training = not sched.forward_only  # False: no graph, nothing kept for a backward
        self.boundary = activation_shape(cfg, topo)  # (B, T/cp[/tp], C)
        self.dtype = DTYPES[cfg.model.dtype]
        self.device = torch.device(cfg.model.device)
        self.inputs: dict = {}  # (mb, chunk) -> stage input (leaf, requires_grad)
        self.outputs: dict = {}  # (mb, chunk) -> stage output, or scaled loss on the last
        self.grad_out: dict = {}  # (mb, chunk) -> what W needs (split backward)
        self.grad_in: dict = {}  # (mb, chunk) -> gradient of the input, to send
        self.recvs: dict = {}  # (kind, mb, chunk) -> (Handle, buffer)
        self.sends: list = []
        self.local: dict = {}  # (tag, mb) -> tensor a rank sends itself (zbv), until taken
        self.handlers = HANDLERS  # action kind -> handler (MoE overlap adds its own)
        self.plain = HANDLERS  # the runner's own (a split B under MoE overlap runs its "B")
        self.loss_sum = 0.0
        self.waited = 0.0
        self.peak_inflight = 0
        # a rank idle in the bubble sleeps between polls (yield) or spins in MPI_Wait
        self.wait = (lambda h: h.wait_yielding()) if cfg.experimental.p2p_wait == "yield" else (
            lambda h: h.wait())

    def stage(self, a: Action) -> int:
        return self.sched.stage(self.rank, a)

    def splits(self, a: Action) -> bool:
        """Whether ``a``'s microbatch splits its backward on this chunk (it has a ``W``):
        its weight matmuls defer to ``W`` from the forward on."""
        return (a.microbatch, a.c) in self.deferred

    def is_last(self, a: Action) -> bool:
        return self.stage(a) == self.sched.stages - 1

    def take(self, kind: str, a: Action) -> torch.Tensor:
        """Wait for the receive posted by the ``kind`` action of ``a``'s microbatch."""
        handle, buf = self.recvs.pop((kind, a.microbatch, a.c))
        if buf is None:  # from this rank itself (the tip of zbv's V): handed over, no MPI
            return self.local.pop(handle)
        t0 = time.perf_counter()
        self.wait(handle)
        self.waited += time.perf_counter() - t0
        return buf

    def drop(self, key) -> None:
        for d in (self.inputs, self.outputs, self.grad_out):
            d.pop(key, None)

    def forwarded(self, a: Action, out: torch.Tensor) -> None:
        """Take the output of ``a``'s forward: on the last stage its loss is summed (and, in
        training, scaled for the backward); an activation is kept for its send."""
        if self.is_last(a):
            self.loss_sum += float(out.detach())
            if not self.training:
                return
            out = out * self.loss_scale
        self.outputs[(a.microbatch, a.c)] = out
        self.peak_inflight = max(self.peak_inflight, len(self.outputs))


# -- handlers: one per action kind -------------------------------------------------------
def _forward(st: StepState, a: Action) -> None:
    # token ids (B, T), targets (B, T) [, document ids and positions (B, 2, T): every stage]
    x, y, *doc = st.microbatches[a.microbatch]
    if st.stage(a) > 0:
        x = st.take("RF", a)  # (B, T[/tp], C)
        if st.training:  # a leaf: the graph ends here
            st.inputs[(a.microbatch, a.c)] = x.requires_grad_(True)
    st.forwarded(a, st.chunks[a.c](x, y if st.is_last(a) else None, *doc))


def _backward(st: StepState, a: Action) -> None:
    """Input gradient; for a split backward the weight gradient waits for ``W``."""
    key, split = (a.microbatch, a.c), st.splits(a)
    grad = None if st.is_last(a) else st.take("RB", a)
    out, x = st.outputs[key], st.inputs.get(key)
    chunk = st.chunks[a.c]
    # ZeRO-3: the chunk's gathered units are freed after (B: by the output hooks too)
    with (st.sharded.backward_pass(chunk, split) if st.sharded else
          contextlib.nullcontext()):
        if split:  # B: all but the weight matmuls (input_grad); W follows later
            gx, st.grad_out[key] = input_grad(out, grad, x)
        else:
            torch.autograd.backward(out, grad)
    if split:
        if gx is not None:
            st.grad_in[key] = gx
        return
    if x is not None:
        st.grad_in[key] = x.grad
    st.drop(key)


def _weight(st: StepState, a: Action) -> None:
    """Weight gradient of a split backward: the matmuls ``B`` kept, into the chunk's
    ``.grad`` (no weight is read: nothing to gather under ZeRO-3)."""
    key = (a.microbatch, a.c)
    st.grad_out[key].apply()
    st.drop(key)


def _post_recv(st: StepState, a: Action) -> None:
    peer, tag = st.sched.peer(st.rank, a)
    if peer == st.rank:  # zbv: the tensor is handed over by _post_send, no buffer, no copy
        st.recvs[(a.kind, a.microbatch, a.c)] = ((tag, a.microbatch), None)
        return
    buf = torch.empty(st.boundary, dtype=st.dtype, device=st.device)
    st.recvs[(a.kind, a.microbatch, a.c)] = (st.topo.pp_comm.irecv(buf, peer, tag), buf)


def _post_send(st: StepState, a: Action) -> None:
    key = (a.microbatch, a.c)
    if a.kind == "SB":
        t = st.grad_in.pop(key)
    else:  # forward-only: the activation is not needed after its send
        t = (st.outputs[key] if st.training else st.outputs.pop(key)).detach()
    peer, tag = st.sched.peer(st.rank, a)
    if peer == st.rank:
        st.local[(tag, a.microbatch)] = t
        return
    st.sends.append(st.topo.pp_comm.isend(t.contiguous(), peer, tag))


@contextlib.contextmanager
def _no_span(name: str):
    yield


HANDLERS = {"F": _forward, "B": _backward, "W": _weight,
            "RF": _post_recv, "RB": _post_recv, "SF": _post_send, "SB": _post_send}
COMPUTE_KINDS = ("F", "B", "W")


def execute(st: StepState, timers=None) -> dict[str, float]:
    """Run this rank's list; returns compute seconds per kind (waits excluded), the idle
    seconds and the wall seconds of the step. Not collective; the p2p partners are the pp
    neighbours (peers of ``link``)."""
    busy: Counter = Counter()
    span = timers.action if timers is not None else _no_span
    t_start = time.perf_counter()
    for a in st.sched.ranks[st.rank]:
        handler = st.handlers.get(a.kind)
        if handler is None:
            raise ValueError(f"rank {st.rank}: no handler for action {a} (kind {a.kind!r})")
        t0, w0 = time.perf_counter(), st.waited
        with span(str(a)), weight_grad.armed(st.splits(a)):  # matmuls defer to W or not
            handler(st, a)
        if a.kind in COMPUTE_KINDS:
            busy[a.kind] += time.perf_counter() - t0 - (st.waited - w0)
    t0 = time.perf_counter()
    for h in st.sends:
        st.wait(h)
    st.waited += time.perf_counter() - t0
    wall = time.perf_counter() - t_start
    if st.outputs or st.recvs or st.local:
        raise RuntimeError(f"rank {st.rank}: schedule left {len(st.outputs)} activations and "
                           f"{len(st.recvs)} receives behind")
    return {**{f"pp_{k}": busy[k] for k in COMPUTE_KINDS}, "pp_step": wall,
            "pp_idle": wall - sum(busy.values()), "pp_peak_inflight": st.peak_inflight}


def _state(chunks, microbatches, topo, cfg, loss_scale: float, sched: Schedule,
           sharded=None) -> StepState:
    """The step's state for ``sched``, expanded with the expert exchange actions when
    ``schedule.moe_overlap`` applies (their handlers added)."""
    expanded = moe_overlap.overlapped(cfg, sched)  # MoE: D/E/C/G actions
    st = StepState(chunks, microbatches, topo, cfg, loss_scale, expanded, sharded)
    if expanded is not sched:
        st.handlers = {**HANDLERS, **moe_executor.handlers_for(expanded)}
    return st


def run_step(chunks, microbatches, topo, cfg, loss_scale: float,
             timers=None, sharded=None) -> tuple[float, dict[str, float]]:
    """Forward and backward of every microbatch by this rank's schedule; gradients accumulate
    in the parameters' ``.grad``. Returns (the sum of token losses this rank computed, non-zero
    only on the last stage; this rank's timing of the step, see :func:`execute`).
    ``loss_scale`` = 1 / tokens in the global batch (times float16's loss scale), applied to
    the token loss and to the MoE layers' auxiliary losses. Point-to-point over
    ``topo.pp_comm`` only (no collective of its own; tp/ep ops inside the model are, and so
    are ZeRO-3's gathers:
    ``sharded``, the ``ShardedParams`` that frees what each backward leaves gathered)."""
    set_loss_scale(chunks, loss_scale)
    st = _state(chunks, microbatches, topo, cfg, loss_scale,
                schedule_for(cfg, len(microbatches)), sharded)
    timing = execute(st, timers)
    return st.loss_sum, timing


@torch.no_grad()
def run_forward(chunks, microbatches, topo, cfg, timers=None) -> float:
    """Forward of every microbatch by this config's forward-only schedule (evaluation):
    returns the sum of token losses this rank computed (non-zero only on the last stage,
    unscaled). Point-to-point over ``topo.pp_comm`` with the training links and tags; it
    waits for its own sends before returning, like :func:`run_step`, so the two never
    share a message. No gradient, no graph."""
    st = _state(chunks, microbatches, topo, cfg, 1.0,
                schedule_for(cfg, len(microbatches), forward_only=True))
    execute(st, timers)
    return st.loss_sum


def pipeline_metrics(topo, cfg, timing: dict, logged: bool = True) -> dict:
    """Measured bubble next to the simulator's, for metrics.jsonl. Collective over
    ``topo.pp_comm`` on logging steps (``logged``); {} when pp == 1 or on other steps (every
    rank agrees).

    ``pp_bubble``: mean over pp ranks of (longest rank's step - own compute) / longest step;
    ``pp_bubble_sim``: the simulator's bubble for this schedule with each rank's measured
    mean cost per action kind; ``pp_bubble_ranks``/``pp_idle_s``: per pp rank."""
    if topo.pp_size == 1 or not logged:
        return {}
    keys = ("pp_F", "pp_B", "pp_W", "pp_step", "pp_peak_inflight")
    mine = [float(timing.get(k, 0.0)) for k in keys]
    rows = topo.pp_comm.allgather_obj(mine)
    sched = schedule_for(cfg, microbatch_count(cfg))
    span = max(r[3] for r in rows)
    busy = [r[0] + r[1] + r[2] for r in rows]
    measured = [(span - b) / span for b in busy]
    per_action = []
    for rank, r in enumerate(rows):
        n = Counter(a.kind for a in sched.ranks[rank])
        per_action.append({k: r[i] / n[k] if n[k] else 0.0 for i, k in enumerate("FBW")})
    sim = simulate(sched, costs=lambda rank, a: per_action[rank].get(a.kind, 0.0))
    return {"pp_bubble": sum(measured) / len(measured), "pp_bubble_sim": sim.bubble,
            "pp_bubble_ranks": measured, "pp_idle_s": [span - b for b in busy],
            "pp_peak_inflight": [int(r[4]) for r in rows]}
