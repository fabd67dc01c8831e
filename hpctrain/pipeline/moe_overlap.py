"""Expert all-to-alls as schedule actions, overlapped with another microbatch's compute.

With ``schedule.moe_overlap = true`` a stage's forward and backward are cut at the MoE token
exchanges (``pipeline.moe_executor``). Per MoE layer of the chunk, forward ``F3`` gains

  ``D3`` post the dispatch ``Ialltoallv`` (ep_comm)   ``E3`` wait for it, run the experts
  ``C3`` post the combine ``Ialltoallv``              ``G3`` wait, run on to the next dispatch

and backward ``B3`` (the last layer first, unless that backward is split into B/W, i.e. has a
``W``: then its exchanges stay blocking inside autograd)

  ``CB3`` post the combine's gradient to the experts  ``XB3`` wait, backward of the experts
  ``DB3`` post the dispatch's gradient home           ``YB3`` wait, backward to the next cut

:func:`expand` starts from the eager list (each compute with its segments back to back) and
lets each pair of adjacent computes of different microbatches *ping-pong*: run one until it
posts an exchange, then the other until it posts one, and so on, so every exchange travels
while the other microbatch computes (1F1B steady state: ``B0 CB0 F1 D1 XB0 DB0 E1 C1 YB0
G1``; GPipe: two forwards; ``dualpipev``: its F&B pairs first). A pair is kept only if the
simulator (matching, order, deadlock) still accepts the whole schedule: pairing delays the
first one's sends, which another stage may be waiting for. Ranks of one ep_comm share a pp
rank and so one list (the expansion is deterministic); :func:`check_ep_order` checks that
lists given to the ranks of one ep_comm post their collectives in the same order, and the
runner applies it to the real lists once per schedule (``moe_executor.check_ep_comm``, an
all-gather over ep_comm).

Evidence: each action is a ``timers.action`` span in the trace (``D3``/``E3``...), and
``metrics.jsonl`` has ``moe_a2a_s``/``moe_a2a_exposed_s``/``moe_a2a_hidden_s`` per step.
"""

from __future__ import annotations

import dataclasses
import functools

from .actions import COMPUTE, Action, Schedule, deferred, fb_pairs
from .placement import partition
from .schedules import kind_of, layer_ranges
from .simulate import ScheduleError, simulate

SEGMENTS = ("D", "E", "C", "G")  # per MoE layer, after F
BACK_SEGMENTS = ("CB", "XB", "DB", "YB")  # per MoE layer, after B (last layer first)
POSTS = ("D", "C", "CB", "DB")  # actions that post a nonblocking exchange on ep_comm
TRANSFERS = ("SF", "RF", "SB", "RB")  # pp point-to-point: not on ep_comm


# -- schedules (pure) -------------------------------------------------------------------
def moe_layers_per_stage(model_cfg, stages: int, ranges=None) -> list[int]:
    """Number of MoE blocks on each virtual stage (balanced, or the given layer ranges)."""
    ranges = ranges if ranges is not None else partition(model_cfg.n_layers, stages)
    return [sum(model_cfg.moe_layer(i) for i in r) for r in ranges]


def _segmented(a: Action, n: int, split: set) -> list[Action]:
    """``a`` followed by its exchange segments (a split backward ``B``/``W``, one whose
    (microbatch, chunk) is in ``split``, has none)."""
    whole = (a.microbatch, a.c) not in split
    kinds = SEGMENTS if a.kind == "F" else BACK_SEGMENTS if a.kind == "B" and whole else ()
    return [a] + [Action(k, a.microbatch, a.chunk) for _ in range(n) for k in kinds]


def _ping_pong(first: list[Action], second: list[Action]) -> list[Action]:
    """Interleave two microbatches' segment lists, switching after every posted exchange."""
    out, lists, turn = [], [list(first), list(second)], 0
    while any(lists):
        if not lists[turn]:
            turn = 1 - turn
        while lists[turn]:
            a = lists[turn].pop(0)
            out.append(a)
            if a.kind in POSTS:
                break
        turn = 1 - turn
    return out


def _expand_rank(actions, moe_of, pairs) -> list[Action]:
    """One rank's list with exchange segments: each compute with its segments back to back,
    except a compute at an index in ``pairs``, which ping-pongs with the next compute (of
    another microbatch); an unsegmented one lets the other go first (``W0 F1`` ->
    ``F1 D1 W0 E1 ...``). Sends of the first wait for the end of the pair."""
    split = deferred(actions)
    acts, out, i = list(actions), [], 0

    def full(a):
        return _segmented(a, moe_of(a), split)

    while i < len(acts):
        a = acts[i]
        if a.kind not in COMPUTE:
            out.append(a)
            i += 1
            continue
        j = _partner(acts, i, full) if i in pairs else None
        if j is None:
            out += full(a)
            i += 1
            continue
        fa, fb, between = full(a), full(acts[j]), acts[i + 1:j]
        sends = [x for x in between if x.kind in ("SF", "SB") and x.microbatch == a.microbatch]
        out += [x for x in between if x not in sends]
        out += _ping_pong(fb, fa) if len(fa) == 1 else _ping_pong(fa, fb)
        out += sends
        i = j + 1
    return out


def _partner(acts, i: int, full) -> int | None:
    """Index of the compute ``acts[i]`` can ping-pong with, if any."""
    j = next((k for k in range(i + 1, len(acts)) if acts[k].kind in COMPUTE), None)
    if j is None or acts[j].microbatch == acts[i].microbatch:
        return None
    return j if len(full(acts[i])) > 1 or len(full(acts[j])) > 1 else None


def expand(sched: Schedule, moe_per_stage: list[int]) -> Schedule:
    """``sched`` with expert exchange actions. Starts from the eager expansion and enables
    the ping-pong of each adjacent pair in turn, keeping it only if the simulator still
    accepts the whole schedule (pairing can delay a send another stage waits for). Pure;
    deterministic, so ranks of one ep_comm (one pp rank) get the same list."""
    pairs: list[set[int]] = [set() for _ in sched.ranks]

    def build_with(pairs) -> Schedule:
        ranks = tuple(tuple(_expand_rank(acts, lambda a, r=r: moe_per_stage[sched.stage(r, a)],
                                         pairs[r])) for r, acts in enumerate(sched.ranks))
        return dataclasses.replace(sched, ranks=ranks)

    best = build_with(pairs)
    simulate(best)  # the eager expansion must run
    for r, acts in enumerate(sched.ranks):
        for i in _candidates(sched, acts):
            pairs[r].add(i)
            try:
                trial = build_with(pairs)
                simulate(trial)
                best = trial
            except ScheduleError:
                pairs[r].discard(i)
    return best


def _candidates(sched: Schedule, acts) -> list[int]:
    """The computes of one rank to try pairing with the next, in turn: dualpipev's F&B pairs
    first (``actions.fb_pairs``), then every other compute that leaves them whole."""
    designed = fb_pairs(acts) if kind_of(sched.kind).fb_pairs else []
    taken = {k for pair in designed for k in pair}
    computes = [i for i, a in enumerate(acts) if a.kind in COMPUTE]
    rest = [i for i, j in zip(computes, computes[1:] + [None])
            if i not in taken and j not in taken]
    return [i for i, _ in designed] + rest


def check_ep_order(lists: dict) -> None:
    """Every rank of one ep_comm must post its ep collectives in the same order:
    ``lists`` = {rank: its action list}. Raises ScheduleError at the first mismatch."""
    seqs = {r: [str(a) for a in acts if a.kind not in TRANSFERS] for r, acts in lists.items()}
    (r0, ref), *others = sorted(seqs.items())
    for r, seq in others:
        for pos, (x, y) in enumerate(zip(ref, seq)):
            if x != y:
                raise ScheduleError(f"ep_comm order mismatch: collective #{pos} is {x} on rank "
                                    f"{r0} but {y} on rank {r}")
        if len(seq) != len(ref):
            raise ScheduleError(f"ep_comm order mismatch: rank {r0} posts {len(ref)} "
                                f"collectives, rank {r} posts {len(seq)}")


def overlapped(cfg, sched: Schedule) -> Schedule:
    """``sched`` expanded with the expert exchange actions when ``schedule.moe_overlap``
    applies (an MoE model), else ``sched`` itself. Pure."""
    if not cfg.schedule.moe_overlap or not cfg.model.num_experts:
        return sched
    per_stage = moe_layers_per_stage(cfg.model, sched.stages, layer_ranges(cfg))
    return _expanded(sched, tuple(per_stage))


@functools.lru_cache(maxsize=16)
def _expanded(sched: Schedule, per_stage: tuple) -> Schedule:
    return expand(sched, list(per_stage))
