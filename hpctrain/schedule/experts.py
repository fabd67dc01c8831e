"""Expert all-to-alls as schedule actions, overlapped with another microbatch's compute.

With ``schedule.moe_overlap = true`` a stage's forward is cut at its MoE token exchanges
(:func:`stage_steps`, a generator over ``MoE.steps``). Per MoE layer of the chunk the
forward ``F3`` gains four actions:

  ``D3`` post the dispatch ``Ialltoallv`` over ep_comm     ``E3`` wait for it, run the experts
  ``C3`` post the combine ``Ialltoallv``                  ``G3`` wait for it, run on to the
                                                           next layer's dispatch (or the end)

:func:`expand` places the compute action of *another* microbatch that follows (1F1B steady
state: the backward of an earlier microbatch; GPipe: the next forward) between the first
``D`` and ``E``, so the dispatch travels while that compute runs; two adjacent forwards
(GPipe, 1F1B warm-up) ping-pong, every exchange of one travelling while the other computes;
sends of the forward's output move after its last segment. With pp = 1 a backward followed
by the next forward is also swapped (``B0 F1`` -> ``F1 D1 B0 E1 ...``). The result is
checked by the simulator (matching, order, deadlock); an expansion that fails falls back to
the next simpler one (eager: ``F D E C G`` with nothing in between). Ranks of one ep_comm
share a pp rank and so one list; :func:`check_ep_order` is the check that lists given to
the ranks of one ep_comm post their collectives in the same order.
Backward exchanges stay blocking inside autograd (``parallel.expert._AllToAll``); they drive
the progress of posted exchanges (``parallel.expert.progress``).

Evidence: each action is a ``timers.action`` span in the trace (``D3``/``E3``...), and
``metrics.jsonl`` has ``moe_a2a_s``/``moe_a2a_exposed_s``/``moe_a2a_hidden_s`` per step.
"""

from __future__ import annotations

import time

from ..model.moe import MoE, is_moe_layer
from ..parallel import expert
from ..parallel.pipeline import partition
from .actions import COMPUTE, Action, Schedule
from .simulate import ScheduleError, simulate

SEGMENTS = ("D", "E", "C", "G")  # per MoE layer, after F
EP_COLLECTIVE = ("F", "B", "D", "C")  # actions that post ep_comm collectives, in order


# -- schedules (pure) -------------------------------------------------------------------
def moe_layers_per_stage(model_cfg, stages: int) -> list[int]:
    """Number of MoE blocks on each virtual stage."""
    return [sum(is_moe_layer(model_cfg, i) for i in r)
            for r in partition(model_cfg.n_layers, stages)]


def _segments(a: Action, n: int) -> list[Action]:
    return [Action(k, a.microbatch, a.chunk) for _ in range(n) for k in SEGMENTS]


def _independent(a: Action, b: Action) -> bool:
    return (a.microbatch, a.c) != (b.microbatch, b.c)


def _ping_pong(first: list[Action], second: list[Action]) -> list[Action]:
    """Interleave two forwards' segment lists, switching after every posted exchange."""
    out, lists, turn = [], [list(first), list(second)], 0
    while any(lists):
        if not lists[turn]:
            turn = 1 - turn
        while lists[turn]:
            a = lists[turn].pop(0)
            out.append(a)
            if a.kind in ("D", "C"):
                break
        turn = 1 - turn
    return out


def _expand_rank(actions, moe_of, mode: str) -> list[Action]:
    """One rank's list with MoE segments; ``mode``: "eager", "after" (F then the next
    compute in its dispatch window) or "swap" (also ``B F`` -> ``F D B ...``)."""
    acts, out, i = list(actions), [], 0

    def emit(a):  # a compute action with all its segments back to back
        out.append(a)
        if a.kind == "F":
            out.extend(_segments(a, moe_of(a)))

    while i < len(acts):
        a = acts[i]
        j = next((k for k in range(i + 1, len(acts)) if acts[k].kind in COMPUTE), None)
        if a.kind not in COMPUTE or mode == "eager" or j is None or not _independent(a, acts[j]):
            emit(a) if a.kind in COMPUTE else out.append(a)
            i += 1
            continue
        b, between = acts[j], acts[i + 1:j]
        if a.kind == "F" and moe_of(a):  # F_a D_a [b] E_a C_a G_a ... then a's sends
            sends = [x for x in between if x.kind == "SF" and not _independent(x, a)]
            out += [x for x in between if x not in sends]
            if b.kind == "F" and moe_of(b):  # two forwards: each one's exchanges in flight
                out += _ping_pong([a, *_segments(a, moe_of(a))],  # while the other computes
                                  [b, *_segments(b, moe_of(b))])
            else:
                out += [a, *_segments(a, 1)[:1]]
                emit(b)
                out += _segments(a, moe_of(a))[1:]
            out += sends
            i = j + 1
        elif mode == "swap" and b.kind == "F" and moe_of(b):  # B_a F_b -> F_b D_b B_a E_b ..
            recvs = [x for x in between if x.kind in ("RF", "RB")]
            out += recvs + [b, *_segments(b, 1)[:1], a]
            out += [x for x in between if x not in recvs] + _segments(b, moe_of(b))[1:]
            i = j + 1
        else:
            emit(a)
            i += 1
    return out


def expand(sched: Schedule, moe_per_stage: list[int], mode: str = "swap") -> Schedule:
    """``sched`` with expert exchange actions. Tries ``mode``, then simpler modes, keeping the
    first expansion the simulator accepts (pure; raises ScheduleError if none does)."""
    modes = ("swap", "after", "eager")
    errors = []
    for m in modes[modes.index(mode):]:
        if m == "swap" and sched.pp > 1:
            continue  # lifting a forward over a backward can deadlock across stages
        ranks = tuple(tuple(_expand_rank(acts, lambda a, r=r: moe_per_stage[sched.stage(r, a)],
                                         m)) for r, acts in enumerate(sched.ranks))
        out = Schedule(sched.kind, sched.pp, sched.virtual, sched.microbatches, ranks)
        try:
            simulate(out)
            return out
        except ScheduleError as e:
            errors.append(f"{m}: {e}")
    raise ScheduleError("no MoE expansion of the schedule runs: " + "; ".join(errors))


def check_ep_order(lists: dict) -> None:
    """Every rank of one ep_comm must post its ep collectives in the same order:
    ``lists`` = {rank: its action list}. Raises ScheduleError at the first mismatch."""
    seqs = {r: [str(a) for a in acts if a.kind in EP_COLLECTIVE] for r, acts in lists.items()}
    (r0, ref), *others = sorted(seqs.items())
    for r, seq in others:
        for pos, (x, y) in enumerate(zip(ref, seq)):
            if x != y:
                raise ScheduleError(f"ep_comm order mismatch: collective #{pos} is {x} on rank "
                                    f"{r0} but {y} on rank {r}")
        if len(seq) != len(ref):
            raise ScheduleError(f"ep_comm order mismatch: rank {r0} posts {len(ref)} "
                                f"collectives, rank {r} posts {len(seq)}")


# -- execution (the runner's handlers for expanded schedules) ---------------------------
def stage_steps(stage, x, targets):
    """``GPTStage.forward`` (and ``Block.forward``) as a generator cut at the MoE
    exchanges: yields ``MoE.steps`` requests, returns the loss sum or the activations."""
    if stage.cfg.recompute:
        raise ValueError("schedule.moe_overlap does not support model.recompute")
    ops = stage.ops
    if stage.first:
        x = stage.embed_tokens(x)
    for block in stage.blocks.values():
        if isinstance(block.mlp, MoE):
            h = x + ops.exit_tp(block.attn(ops.enter_tp(block.norm1(x))))
            m = yield from block.mlp.steps(ops.enter_tp(block.norm2(h)))
            x = h + ops.exit_tp(m)
        else:
            x = block(x)
        expert.progress()
    return stage.head_loss(x, targets) if stage.last else x


def _advance(st, a: Action, value=None) -> None:
    """Run microbatch ``a``'s forward to its next exchange request or its end."""
    key = (a.microbatch, a.c)
    state = st.moe_steps[key]
    try:
        state["req"] = state["gen"].send(value)
    except StopIteration as stop:
        del st.moe_steps[key]
        out = stop.value
        if st.is_last(a):
            st.loss_sum += float(out.detach())
            out = out * st.loss_scale
        st.outputs[key] = out
        st.peak_inflight = max(st.peak_inflight, len(st.outputs))


def _forward(st, a: Action) -> None:
    key = (a.microbatch, a.c)
    x, y = st.microbatches[a.microbatch]
    if st.stage(a) > 0:
        x = st.take("RF", a).requires_grad_(True)
        st.inputs[key] = x
    if not hasattr(st, "moe_steps"):
        st.moe_steps = {}
    gen = stage_steps(st.chunks[a.c], x, y if st.is_last(a) else None)
    st.moe_steps[key] = {"gen": gen}
    _advance(st, a, None)


def _post(st, a: Action) -> None:
    """D/C: post the requested exchange nonblocking over ep_comm."""
    state = st.moe_steps[(a.microbatch, a.c)]
    layer, kind, rows, send_rows, recv_rows = state["req"]
    expect = "dispatch" if a.kind == "D" else "combine"
    if kind != expect:
        raise RuntimeError(f"action {a}: the forward asks for a {kind}, not a {expect}")
    state["pending"] = expert.post_exchange(layer.exchange, rows, send_rows, recv_rows)


def _resume(st, a: Action) -> None:
    """E/G: wait for the posted exchange and compute on to the next one."""
    handle, finish = st.moe_steps[(a.microbatch, a.c)].pop("pending")
    if handle is not None:
        t0 = time.perf_counter()
        expert.wait_exchange(handle)
        st.waited += time.perf_counter() - t0
    _advance(st, a, finish())


HANDLERS = {"F": _forward, "D": _post, "C": _post, "E": _resume, "G": _resume}


def overlapped(cfg, sched: Schedule) -> tuple[Schedule, dict]:
    """(expanded schedule, handler overrides) when ``schedule.moe_overlap`` applies, else
    (sched, {})."""
    if not getattr(cfg.schedule, "moe_overlap", False) or not cfg.model.num_experts:
        return sched, {}
    return expand(sched, moe_layers_per_stage(cfg.model, sched.stages)), HANDLERS
