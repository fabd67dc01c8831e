"""Pipeline schedules as data: for each pp rank, the list of actions it executes in one step.

An :class:`Action` is ``kind`` + ``microbatch`` + ``chunk`` (this rank's virtual stage index,
``None`` when the rank holds one chunk). Its string form is the vocabulary of docs/design.md:
``F3`` forward of microbatch 3, ``B3`` backward (input gradient; the whole backward when the
schedule has no ``W``), ``W3`` weight gradient, ``SF3``/``RF3`` send/receive an activation,
``SB3``/``RB3`` send/receive a gradient; ``F3v1`` is microbatch 3 on the rank's chunk 1.

Virtual stage ``s`` of ``S = pp * v`` lives on pp rank ``s % pp`` as chunk ``s // pp``, except
in the V-shaped ``zbv`` and ``dualpipev`` (``pipeline.placement.chunks_of_rank``: rank r holds
stages r and 2pp-1-r). A schedule may split some backwards and not others (``dualpipev``): a
``B`` is split exactly when the rank also has a ``W`` of the same microbatch and chunk
(:func:`deferred`).
Receives (``R*``) *post* a nonblocking receive; the compute action that needs the data waits
for it. Sends (``S*``) post a nonblocking send right after the compute that produced the data.
Every schedule here is built in two steps: the order of compute actions per rank
(the kind's order function, named in its :mod:`~hpctrain.pipeline.schedules` entry), then
:func:`with_comm` inserts the transfers (receives posted one
compute action ahead of their use). A *forward-only* schedule
(``schedules.build(..., forward_only=True)``,
what evaluation runs) is the same kind's order without ``B``/``W``, with its ``RF``/``SF``.
New kinds (e.g. expert dispatch ``D``/combine ``C``) are new ``kind`` strings; nothing here
enumerates kinds except :data:`COMPUTE`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .placement import chunks_of_rank, rank_of_stage

COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    chunk: int | None = None  # local virtual stage index; None: the rank's only chunk

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + ("" if self.chunk is None else f"v{self.chunk}")

    @property
    def c(self) -> int:
        """The chunk index, 0 when the rank holds one chunk."""
        return self.chunk or 0


_PATTERN = re.compile(r"^([A-Z]+)(\d+)(?:v(\d+))?$")


def parse(text: str) -> Action:
    """``"SF3v1"`` -> Action("SF", 3, 1); the inverse of ``str(action)``."""
    m = _PATTERN.match(text.strip())
    if not m:
        raise ValueError(f"not an action: {text!r} (expected e.g. F3, SB2, W0v1)")
    return Action(m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))


@dataclass(frozen=True)
class Schedule:
    """One step's actions for every pp rank (``ranks[r]`` is rank r's list, in order)."""

    kind: str
    pp: int
    virtual: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    forward_only: bool = False  # F and its transfers only: evaluation, no backward
    style: str = "loop"  # virtual stages on ranks: "loop" or "v" (its registry entry's)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def stage(self, rank: int, action: Action) -> int:
        """The global virtual stage an action of ``rank`` runs on."""
        return chunks_of_rank(rank, self.pp, self.virtual, self.style)[action.c]

    def peer(self, rank: int, action: Action) -> tuple[int, int]:
        """(peer pp rank, tag) of a transfer action of ``rank`` (see :func:`link`)."""
        return link(action, self.stage(rank, action), self.pp, self.style)

    def text(self, rank: int) -> str:
        return " ".join(str(a) for a in self.ranks[rank])


def link(action: Action, stage: int, pp: int, style: str = "loop") -> tuple[int, int]:
    """(peer pp rank, MPI tag) of a transfer action on virtual stage ``stage``.

    The tag names the receiving stage and the direction (even: activation, odd: gradient),
    so a sender and its receiver compute the same tag; on one (peer, tag) link messages match
    in posting order. In the V placement the two middle stages share rank pp-1: that link is
    the rank itself."""
    if action.kind == "SF":
        return rank_of_stage(stage + 1, pp, style), 2 * (stage + 1)
    if action.kind == "RF":
        return rank_of_stage(stage - 1, pp, style), 2 * stage
    if action.kind == "SB":
        return rank_of_stage(stage - 1, pp, style), 2 * (stage - 1) + 1
    if action.kind == "RB":
        return rank_of_stage(stage + 1, pp, style), 2 * stage + 1
    raise ValueError(f"{action} is not a transfer")


# -- compute orders --------------------------------------------------------------------
def gpipe(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """Warm up with pp-rank-1 forwards, then alternate F and B, then drain the Bs: at most
    pp - rank microbatches in flight."""
    warm = min(pp - rank - 1, m)
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warm, m)]


def interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches in groups of pp, each group passes through
    chunk 0, 1, ..., v-1 forward and v-1, ..., 0 backward."""
    if v == 1:  # one chunk per rank: plain 1F1B
        return one_f_one_b(pp, m, rank)
    total = m * v

    def nth(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (k // (pp * v)) * pp + k % pp, (v - 1 - chunk if backward else chunk)

    def act(kind: str, k: int) -> Action:
        mb, chunk = nth(k, kind == "B")
        return Action(kind, mb, chunk)

    warm = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    out = [act("F", k) for k in range(warm)]
    for i in range(total - warm):
        out += [act("F", warm + i), act("B", i)]
    return out + [act("B", k) for k in range(total - warm, total)]


def zb_h1(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B with the backward split into B (input gradient,
    on the critical path) and W (weight gradient). Rank r warms up with pp - r forwards like
    1F1B, then runs B, W, F per microbatch, but its W passes lag its B passes by r: the
    deferred W fill the cooldown that 1F1B leaves idle. Every rank then holds at most pp
    microbatches between F and W (1F1B's peak, on rank 0); with unit costs and W <= F,
    m >= pp the makespan is m(F+B+W) + (pp-1)(F+B-W)."""
    warm = min(pp - rank, m)
    out = [Action("F", i) for i in range(warm)]
    nw = 0
    for k in range(m):
        out.append(Action("B", k))
        if k >= rank:
            out.append(Action("W", nw))
            nw += 1
        if k + warm < m:
            out.append(Action("F", k + warm))
    return out + [Action("W", j) for j in range(nw, m)]


def zbv(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """ZB-V (Qi et al., zero-bubble paper section 6): two chunks per rank in a V (chunk 0 is
    stage r, chunk 1 stage 2pp-1-r). Warm-up: 2(pp-r)-1 chunk-0 forwards, r pairs (F on
    chunk 1, F on chunk 0), pp-r triples F B W on chunk 1; steady: F B W on chunk 0 then on
    chunk 1; cool-down: r pairs of B, pp-r (B, W) on chunk 0, then the remaining W. Built for
    max(m, 2pp-1) microbatches and cut to m (the order stays sound). With F=B=W every rank
    is busy from its first action to its last: no bubble inside a rank's span; peak pp
    microbatches of whole-stage activations (2pp chunk-microbatches), as 1F1B."""
    n = max(2 * pp - 1, m)
    out: list[Action] = []
    done = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def add(kind: str, chunk: int, then_w: bool = False) -> None:
        out.append(Action(kind, done[(kind, chunk)], chunk))
        done[(kind, chunk)] += 1
        if then_w:
            out.append(Action("W", done[(kind, chunk)] - 1, chunk))

    for _ in range(2 * (pp - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - rank):
        add("F", 1)
        add("B", 1, then_w=True)
    while done[("F", 1)] < done[("F", 0)] or done[("F", 0)] < n:
        if done[("F", 0)] < n:
            add("F", 0)
        add("B", 0, then_w=True)
        add("F", 1)
        add("B", 1, then_w=True)
    w = [done[("B", 0)], done[("B", 1)]]
    for _ in range(rank):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - rank):
        add("B", 0)
        out.append(Action("W", w[0], 0))
        w[0] += 1
    out += [Action("W", j, 1) for j in range(w[1], done[("B", 1)])]
    out += [Action("W", j, 0) for j in range(w[0], done[("B", 0)])]
    return [a for a in out if a.microbatch < m]


def dualpipev(pp: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab): the V of zbv (chunk 0 is
    stage r, chunk 1 stage 2pp-1-r), m >= 2pp. Phases: 2(pp-r-1) chunk-0 forwards; r+1
    pairs F0 F1; pp-r-1 triples B1 W F1 (split); the steady state, m-2pp+r+1 times the two
    overlapped F&B pairs (F0 with B1, F1 with B0: the forward of one microbatch next to the
    whole backward of another, the unit ``schedule.moe_overlap`` runs ping-pong); pp-r-1
    times B1 then the pair F1 B0; r+1 pairs B1 B0, whose second half split; pp-r-1 pairs of
    a W then a split B0; the r+1 remaining W. Each W is the oldest split B's (a queue).
    Whole backwards leave no W; split ones fill the cool-down. Peak 2pp+1 chunk-microbatches
    on every rank (the DualPipe table's PP+1 for its PP = 2pp stages)."""
    out: list[Action] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queue: list[Action] = []  # split B's waiting for their W, oldest first

    def add(kind: str, chunk: int, split: bool = False) -> None:
        out.append(Action(kind, count[(kind, chunk)], chunk))
        count[(kind, chunk)] += 1
        if split:
            queue.append(Action("W", out[-1].microbatch, chunk))

    def weight() -> None:
        out.append(queue.pop(0))

    for _ in range(2 * (pp - rank - 1)):
        add("F", 0)
    for _ in range(rank + 1):
        add("F", 0)
        add("F", 1)
    for _ in range(pp - rank - 1):
        add("B", 1, split=True)
        weight()
        add("F", 1)
    for _ in range(m - 2 * pp + rank + 1):
        for fc, bc in ((0, 1), (1, 0)):
            add("F", fc)
            add("B", bc)
    for _ in range(pp - rank - 1):
        add("B", 1)
        add("F", 1)
        add("B", 0)
    split, half = False, (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        add("B", 1, split)
        split = split or (i == half and rank % 2 == 0)
        add("B", 0, split)
    for _ in range(pp - rank - 1):
        weight()
        add("B", 0, split=True)
    while queue:
        weight()
    return out


def deferred(actions) -> set[tuple[int, int]]:
    """(microbatch, chunk index) of the split backwards in one rank's list: those with a
    ``W`` (their ``B`` leaves the weight gradients to it); the others' ``B`` is whole."""
    return {(a.microbatch, a.c) for a in actions if a.kind == "W"}


def fb_pairs(actions) -> list[tuple[int, int]]:
    """Indices (i, j) of the overlapped F&B pairs in one rank's list: a forward whose next
    compute is a whole backward (no ``W``) of another microbatch. ``schedule.moe_overlap``
    runs each such pair ping-pong; the simulator can price a pair as one unit."""
    split, pairs = deferred(actions), []
    comp = [(i, a) for i, a in enumerate(actions) if a.kind in COMPUTE]
    for (i, a), (j, b) in zip(comp, comp[1:]):
        if (a.kind == "F" and b.kind == "B" and a.microbatch != b.microbatch
                and (b.microbatch, b.c) not in split):
            pairs.append((i, j))
    return pairs


def with_comm(orders: list[list[Action]], pp: int, virtual: int,
              style: str = "loop") -> list[list[Action]]:
    """Insert transfers: a send right after the compute that produced its tensor, a receive
    posted one compute action before the compute that needs it (or first)."""
    S = pp * virtual
    out = []
    for rank, order in enumerate(orders):
        recv_before: dict[int, list[Action]] = {}
        sends_after: dict[int, list[Action]] = {}
        stages = chunks_of_rank(rank, pp, virtual, style)
        for i, a in enumerate(order):
            s = stages[a.c]
            if a.kind == "F" and s > 0:
                recv_before.setdefault(max(i - 1, 0), []).append(Action("RF", a.microbatch,
                                                                        a.chunk))
            if a.kind == "B" and s < S - 1:
                recv_before.setdefault(max(i - 1, 0), []).append(Action("RB", a.microbatch,
                                                                        a.chunk))
            if a.kind == "F" and s < S - 1:
                sends_after[i] = [Action("SF", a.microbatch, a.chunk)]
            if a.kind == "B" and s > 0:
                sends_after[i] = [Action("SB", a.microbatch, a.chunk)]
        seq: list[Action] = []
        for i, a in enumerate(order):
            seq += recv_before.get(i, []) + [a] + sends_after.get(i, [])
        out.append(seq)
    return out
