"""Run every pp rank's action list in one process (no MPI): prove a schedule sound, time it.

:func:`simulate` checks that
  * every receive is met by a send on the same link (peer, tag) in posting order, with the
    same microbatch, and every send by a receive;
  * each (microbatch, chunk) runs F once, then B once, then W once if the rank splits its
    backward (every backward for zb-h1 and zbv, those with a W for dualpipev; a
    forward-only schedule: F once, no B or W); a send comes after the compute
    that produced its tensor and a compute that needs a received tensor comes after the
    receive was posted;
  * nothing deadlocks (a compute waits only for a send some rank can still reach);
and returns the makespan and bubble (idle) fraction for given per-action costs. Sends never
block (they are nonblocking in the runner); a compute starts when its rank is free and its
received tensor has arrived (the send time plus ``latency``). Errors raise
:class:`ScheduleError` naming the rank, the action and its position in the rank's list.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from .actions import COMPUTE, Action, Schedule, deferred, fb_pairs
from .schedules import REGISTRY

DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}  # unsplit B costs B + W


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names rank, action and position."""


@dataclass
class SimResult:
    """Timing of one step. Bubble conventions (unit costs F=B=W=1, p ranks, m microbatches):

    * ``bubble`` (per total time): mean over ranks of idle / makespan; 1F1B (p-1)/(m+p-1).
      What ``pp_bubble_sim`` and ``hpctrain plan`` print.
    * ``bubble_time`` (the zero-bubble paper's "bubble size"): makespan - the busiest rank's
      compute, in cost units; 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W).
    * ``bubble_rate`` (per ideal time, the paper's table): ``bubble_time`` / the busiest
      rank's compute; 1F1B (p-1)/m, ZB-H1 (p-1)/3m.
    * ``span_bubble`` (per rank's own span, the paper's parallelogram when the next step may
      start early): the most idle time any rank has between its own first and last compute;
      ZB-V 0 when F=B=W.
    """

    makespan: float
    busy: list[float]  # per rank, compute seconds (or cost units)
    peak_inflight: list[int]  # per rank, most chunk-microbatches between F and last B/W
    start: list[float] = field(default_factory=list)  # per rank, its first compute's start
    end: list[float] = field(default_factory=list)  # per rank, its last compute's end
    virtual: int = 1  # chunks per rank

    @property
    def peak_microbatches(self) -> list[float]:
        """Peak activations per rank in whole-stage microbatches (chunk ones / chunks)."""
        return [p / self.virtual for p in self.peak_inflight]

    @property
    def bubble_time(self) -> float:
        return self.makespan - max(self.busy)

    @property
    def bubble_rate(self) -> float:
        return self.bubble_time / max(self.busy) if max(self.busy) else 0.0

    @property
    def span_bubble(self) -> float:
        return max(e - s - b for s, e, b in zip(self.start, self.end, self.busy))

    @property
    def bubble_per_rank(self) -> list[float]:
        return [(self.makespan - b) / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle fraction of all ranks over the makespan (mean over ranks)."""
        return sum(self.bubble_per_rank) / len(self.busy)


def _where(rank: int, i: int, a: Action) -> str:
    return f"rank {rank} action #{i} {a}"


def _needs(sched: Schedule, rank: int, a: Action) -> str | None:
    """The receive kind a compute action waits for, if any."""
    s = sched.stage(rank, a)
    if a.kind == "F" and s > 0:
        return "RF"
    if a.kind == "B" and s < sched.stages - 1:
        return "RB"
    return None


def match(sched: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair receives with sends: {(rank, index of receive): (rank, index of send)}.

    On each link (sender, receiver, tag) the i-th send meets the i-th receive."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, actions in enumerate(sched.ranks):
        for i, a in enumerate(actions):
            if a.kind in ("SF", "SB"):
                peer, tag = sched.peer(r, a)
                sends[(r, peer, tag)].append(i)
            elif a.kind in ("RF", "RB"):
                peer, tag = sched.peer(r, a)
                recvs[(peer, r, tag)].append(i)
    pairs = {}
    for key in sends.keys() | recvs.keys():
        src, dst, tag = key
        s_list, r_list = sends.get(key, []), recvs.get(key, [])
        for j in range(max(len(s_list), len(r_list))):
            if j >= len(r_list):
                a = sched.ranks[src][s_list[j]]
                raise ScheduleError(f"{_where(src, s_list[j], a)}: no receive on rank {dst} "
                                    f"matches it (rank {dst} posts {len(r_list)} on this link)")
            if j >= len(s_list):
                a = sched.ranks[dst][r_list[j]]
                raise ScheduleError(f"{_where(dst, r_list[j], a)}: no send from rank {src} "
                                    f"matches it (rank {src} sends {len(s_list)} on this link)")
            sa, ra = sched.ranks[src][s_list[j]], sched.ranks[dst][r_list[j]]
            if sa.microbatch != ra.microbatch:
                raise ScheduleError(
                    f"{_where(dst, r_list[j], ra)} is met by {_where(src, s_list[j], sa)}: "
                    "sends and receives on a link must be posted in the same microbatch order")
            pairs[(dst, r_list[j])] = (src, s_list[j])
    return pairs


def _check_order(sched: Schedule) -> None:
    """F before B before W per (microbatch, chunk); transfers after/before their compute."""
    for r, actions in enumerate(sched.ranks):
        split = any(a.kind == "W" for a in actions) and (
            sched.kind not in REGISTRY or REGISTRY[sched.kind].split)  # every B with its W
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.microbatch, a.c)
            if a.kind in COMPUTE or a.kind in ("RF", "RB", "SF", "SB"):
                if key in seen:
                    raise ScheduleError(f"{_where(r, i, a)}: repeated (first at #{seen[key]})")
                seen[key] = i
            before = {"B": "F", "W": "B", "SF": "F", "SB": "B"}.get(a.kind)
            if before and (before, a.microbatch, a.c) not in seen:
                raise ScheduleError(f"{_where(r, i, a)}: comes before "
                                    f"{Action(before, a.microbatch, a.chunk)}")
            need = _needs(sched, r, a) if a.kind in ("F", "B") else None
            if need and (need, a.microbatch, a.c) not in seen:
                raise ScheduleError(f"{_where(r, i, a)}: its input is never received before "
                                    f"it (no {Action(need, a.microbatch, a.chunk)} earlier)")
        if sched.forward_only and any(a.kind in ("B", "W") for a in actions):
            raise ScheduleError(f"rank {r}: a forward-only schedule has a backward action")
        kinds = ("F",) if sched.forward_only else ("F", "B") + (("W",) if split else ())
        for mb in range(sched.microbatches):
            for c in range(sched.virtual):
                chunk = c if sched.virtual > 1 else None
                for kind in kinds:
                    if (kind, mb, c) not in seen:
                        raise ScheduleError(f"rank {r}: {Action(kind, mb, chunk)} is missing")


def _peak_inflight(actions) -> int:
    """Most chunk-microbatches between their F and their last backward action (forward-only:
    an activation lives from its F to its send, 1)."""
    kinds, split = {a.kind for a in actions}, deferred(actions)
    live, peak = 0, 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        last = "W" if (a.microbatch, a.c) in split else "B" if "B" in kinds else "F"
        if a.kind == last:
            live -= 1
    return peak


def _cost_fn(costs, sched: Schedule):
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS, **(costs or {}))

    split = [deferred(actions) for actions in sched.ranks]

    def cost(rank: int, a: Action) -> float:
        if a.kind == "B" and (a.microbatch, a.c) not in split[rank]:
            return (table["B"] + table["W"]) / sched.virtual
        return table.get(a.kind, 0.0) / sched.virtual

    return cost


def simulate(sched: Schedule, costs=None, latency: float = 0.0) -> SimResult:
    """Check ``sched`` and time it. ``costs``: {"F","B","W": cost of a whole stage's pass}
    (divided by the chunks per rank; a B without its W costs B + W), or ``callable(rank, action)``
    returning the cost of that action. Transfers cost nothing but ``latency``."""
    _check_order(sched)
    pairs = match(sched)
    cost = _cost_fn(costs, sched)
    n = sched.pp
    clock, busy, pos = [0.0] * n, [0.0] * n, [0] * n
    first: list[float | None] = [None] * n  # start of each rank's first compute
    sent: dict[tuple[int, int], float] = {}  # (rank, index of send) -> time posted
    posted: dict[tuple[int, str, int, int], int] = {}  # (rank, kind, mb, chunk) -> index
    while True:
        progress = False
        for r in range(n):
            actions = sched.ranks[r]
            while pos[r] < len(actions):
                i, a = pos[r], actions[pos[r]]
                start = clock[r]
                need = _needs(sched, r, a) if a.kind in ("F", "B") else None
                if need:
                    send = pairs[(r, posted[(r, need, a.microbatch, a.c)])]
                    if send not in sent:
                        break  # blocked until the peer reaches its send
                    start = max(start, sent[send] + latency)
                if a.kind in ("RF", "RB"):
                    posted[(r, a.kind, a.microbatch, a.c)] = i
                elif a.kind in ("SF", "SB"):
                    sent[(r, i)] = clock[r]
                else:
                    dt = cost(r, a)
                    if first[r] is None:
                        first[r] = start
                    clock[r] = start + dt
                    busy[r] += dt
                pos[r] += 1
                progress = True
        if all(pos[r] == len(sched.ranks[r]) for r in range(n)):
            break
        if not progress:
            stuck = [f"{_where(r, pos[r], sched.ranks[r][pos[r]])} waits for "
                     f"{_waits_for(sched, pairs, posted, r, pos[r])}"
                     for r in range(n) if pos[r] < len(sched.ranks[r])]
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    peaks = [_peak_inflight(actions) for actions in sched.ranks]
    return SimResult(max(clock), busy, peaks, [f or 0.0 for f in first], clock,
                     sched.virtual)


def _waits_for(sched, pairs, posted, r, i) -> str:
    a = sched.ranks[r][i]
    need = _needs(sched, r, a)
    src, j = pairs[(r, posted[(r, need, a.microbatch, a.c)])]
    return f"{sched.ranks[src][j]} (#{j}) of rank {src}"


def paired(sched: Schedule) -> Schedule:
    """``sched`` with each overlapped F&B pair (``actions.fb_pairs``) run as one unit: the
    forward's sends move after the pair's backward, as when the two chunks overlap (both
    outputs leave at the end of the pair). Price it with :func:`pair_costs`."""
    ranks = []
    for acts in sched.ranks:
        pairs = {acts[i]: acts[j] for i, j in fb_pairs(acts)}
        held, out = {}, []
        for a in acts:
            f = Action("F", a.microbatch, a.chunk)
            if a.kind == "SF" and f in pairs:
                held[pairs[f]] = a
                continue
            out.append(a)
            if a in held:
                out.append(held.pop(a))
        ranks.append(tuple(out))
    return dataclasses.replace(sched, ranks=tuple(ranks))


def pair_costs(sched: Schedule, F: float, B: float, W: float, FB: float):
    """Costs per chunk for :func:`simulate` of a :func:`paired` schedule (DualPipe's
    notation): ``F`` a forward, ``B`` a whole backward, ``W`` its weight part (a split ``B``
    costs B - W), ``FB`` an overlapped F&B pair (its F 0, its B all of FB)."""
    in_pair = [{x for i, j in fb_pairs(acts) for x in (acts[i], acts[j])}
               for acts in sched.ranks]
    split = [deferred(acts) for acts in sched.ranks]

    def cost(rank: int, a: Action) -> float:
        if a in in_pair[rank]:
            return 0.0 if a.kind == "F" else FB
        if a.kind == "B":
            return B - W if (a.microbatch, a.c) in split[rank] else B
        return {"F": F, "W": W}.get(a.kind, 0.0)

    return cost
