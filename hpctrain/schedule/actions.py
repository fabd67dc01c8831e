"""Pipeline schedules as data: for each pp rank, the list of actions it executes in one step.

An :class:`Action` is ``kind`` + ``microbatch`` + ``chunk`` (this rank's virtual stage index,
``None`` when the rank holds one chunk). Its string form is the vocabulary of docs/design.md:
``F3`` forward of microbatch 3, ``B3`` backward (input gradient; the whole backward when the
schedule has no ``W``), ``W3`` weight gradient, ``SF3``/``RF3`` send/receive an activation,
``SB3``/``RB3`` send/receive a gradient; ``F3v1`` is microbatch 3 on the rank's chunk 1.

Virtual stage ``s`` of ``S = pp * v`` lives on pp rank ``s % pp`` as chunk ``s // pp``.
Receives (``R*``) *post* a nonblocking receive; the compute action that needs the data waits
for it. Sends (``S*``) post a nonblocking send right after the compute that produced the data.
Every schedule here is built in two steps: the order of compute actions per rank
(:func:`compute_order`), then :func:`with_comm` inserts the transfers (receives posted one
compute action ahead of their use). New kinds (e.g. expert dispatch ``D``/combine ``C``)
are new ``kind`` strings; nothing here enumerates kinds except :data:`COMPUTE`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1")
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

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def stage(self, rank: int, action: Action) -> int:
        """The global virtual stage an action of ``rank`` runs on."""
        return rank + action.c * self.pp

    def text(self, rank: int) -> str:
        return " ".join(str(a) for a in self.ranks[rank])


def link(action: Action, stage: int, pp: int) -> tuple[int, int]:
    """(peer pp rank, MPI tag) of a transfer action on virtual stage ``stage``.

    The tag names the receiving stage and the direction (even: activation, odd: gradient),
    so a sender and its receiver compute the same tag; on one (peer, tag) link messages match
    in posting order."""
    if action.kind == "SF":
        return (stage + 1) % pp, 2 * (stage + 1)
    if action.kind == "RF":
        return (stage - 1) % pp, 2 * stage
    if action.kind == "SB":
        return (stage - 1) % pp, 2 * (stage - 1) + 1
    if action.kind == "RB":
        return (stage + 1) % pp, 2 * stage + 1
    raise ValueError(f"{action} is not a transfer")


# -- compute orders --------------------------------------------------------------------
def _gpipe(pp: int, m: int, rank: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """Warm up with pp-rank-1 forwards, then alternate F and B, then drain the Bs: at most
    pp - rank microbatches in flight."""
    warm = min(pp - rank - 1, m)
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warm, m)]


def _interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches in groups of pp, each group passes through
    chunk 0, 1, ..., v-1 forward and v-1, ..., 0 backward."""
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


def _zb_h1(pp: int, m: int) -> list[list[Action]]:
    """Zero-bubble H1: backward split into B (input gradient, on the critical path) and W
    (weight gradient, free to move). Built greedily on unit costs with 1F1B's activation
    memory (rank r keeps at most pp - r microbatches between F and W): a free rank runs B if
    its gradient has arrived, else F if allowed and its input has arrived, else a pending W
    (this fills what 1F1B leaves idle)."""
    orders: list[list[Action]] = [[] for _ in range(pp)]
    f_done = [[-1] * m for _ in range(pp)]  # time each F / B finished, -1 not yet
    b_done = [[-1] * m for _ in range(pp)]
    nf, nb, nw = [0] * pp, [0] * pp, [0] * pp
    t = 0
    while any(nw[r] < m for r in range(pp)):
        for r in range(pp):
            i_b, i_f = nb[r], nf[r]
            if i_b < nf[r] and (r == pp - 1 or 0 <= b_done[r + 1][i_b] <= t):
                orders[r].append(Action("B", i_b))
                b_done[r][i_b] = t + 1
                nb[r] += 1
            elif i_f < m and i_f - nw[r] < pp - r and (r == 0 or 0 <= f_done[r - 1][i_f] <= t):
                orders[r].append(Action("F", i_f))
                f_done[r][i_f] = t + 1
                nf[r] += 1
            elif nw[r] < nb[r]:
                orders[r].append(Action("W", nw[r]))
                nw[r] += 1
        t += 1
        if t > 10 * (m + pp) + 10:  # pragma: no cover - a bug in the rules above
            raise RuntimeError("zb-h1 construction did not converge")
    return orders


def check_fits(kind: str, pp: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError with the arithmetic when the microbatch count cannot run ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"schedule.kind={kind!r}; valid: {', '.join(KINDS)}")
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual} "
                         "must all be >= 1")
    if kind != "interleaved" and virtual != 1:
        raise ValueError(f"schedule.kind={kind!r} holds one stage per rank; "
                         f"virtual_stages={virtual} needs schedule.kind='interleaved'")
    if kind == "interleaved" and virtual > 1 and microbatches % pp:
        raise ValueError(
            f"schedule 'interleaved' sends microbatches through the chunks in groups of "
            f"pp={pp}, but there are {microbatches} microbatches ({microbatches} % {pp} = "
            f"{microbatches % pp}); use a multiple of {pp} (train.global_batch_size = "
            "microbatches * dp * micro_batch_size) or schedule.kind='1f1b'/'zb-h1'")


def compute_order(kind: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per rank, the F/B/W actions in execution order (no transfers yet)."""
    check_fits(kind, pp, microbatches, virtual)
    m = microbatches
    if kind == "zb-h1":
        return _zb_h1(pp, m)
    if kind == "interleaved" and virtual > 1:
        return [_interleaved(pp, m, r, virtual) for r in range(pp)]
    build = _gpipe if kind == "gpipe" else _one_f_one_b
    return [build(pp, m, r) for r in range(pp)]


def with_comm(orders: list[list[Action]], pp: int, virtual: int) -> list[list[Action]]:
    """Insert transfers: a send right after the compute that produced its tensor, a receive
    posted one compute action before the compute that needs it (or first)."""
    S = pp * virtual
    out = []
    for rank, order in enumerate(orders):
        recv_before: dict[int, list[Action]] = {}
        sends_after: dict[int, list[Action]] = {}
        for i, a in enumerate(order):
            s = rank + a.c * pp
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


def build(kind: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``kind`` for ``pp`` ranks, ``microbatches`` per step and ``virtual``
    chunks per rank (interleaved only). Pure; raises ValueError when it does not fit."""
    orders = compute_order(kind, pp, microbatches, virtual)
    if virtual == 1:
        orders = [[Action(a.kind, a.microbatch) for a in o] for o in orders]
    ranks = with_comm(orders, pp, virtual)
    return Schedule(kind, pp, virtual, microbatches, tuple(tuple(r) for r in ranks))


def from_config(cfg, microbatches: int) -> Schedule:
    """The schedule a config asks for (``cfg.schedule``, ``cfg.topology.pp``)."""
    s = cfg.schedule
    v = s.virtual_stages if s.kind == "interleaved" else 1
    return build(s.kind, cfg.topology.pp, microbatches, v)
