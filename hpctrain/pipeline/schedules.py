"""The pipeline schedules: one registry entry each, which everything else asks.

An entry (:class:`Kind`) owns its compute order per rank (the builder, ``actions.py`` or a
module of its own), how its chunks sit on the ranks (placement style, chunks per rank), what
its first stage holds in flight (the memory estimate), its fill (the planner's closed-form
bubble), whether its backward splits into B and W, its designed F&B pairs (MoE overlap) and
which of it the planner's search tries. The runner, the simulator, the checks, ``plan`` and
the memory estimate ask :data:`REGISTRY` (or :func:`kind_of`); none tests a schedule's name.

Adding a schedule: its order function (``(pp, microbatches, rank, virtual) -> [Action]``,
F/B/W only; :func:`build` inserts the transfers) and one line in :data:`REGISTRY`
(docs/design.md, "A pipeline schedule").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import actions as a
from . import placement
from .actions import Action, Schedule, with_comm


def _fill(pp: int, m: int) -> float:
    """Microbatches whose activations the first stage holds at once, 1F1B-like: pp."""
    return 1 if pp == 1 else min(pp, m)


@dataclass(frozen=True)
class Kind:
    """One pipeline schedule, as everything that plans or runs it needs it."""

    name: str
    order: Callable[[int, int, int, int], list[Action]]  # (pp, m, rank, virtual) -> F/B/W
    style: str = "loop"  # chunks on ranks: "loop" (stage s on rank s % pp) or "v" (a V)
    chunks: int = 1  # chunks per rank; 0: schedule.virtual_stages (interleaved)
    split: bool = False  # every backward splits into B and W (zero bubble)
    fill: float = 0.0  # closed-form fill: (pp - 1) x busiest / fill; 0: chunks per rank
    in_flight: Callable[[int, int], float] = _fill  # (pp, m) -> first stage's live mbs
    flight_everywhere: bool = False  # every rank holds in_flight (else rank r: minus r)
    fb_pairs: bool = False  # designed F&B pairs that hide expert all-to-alls
    min_microbatches: int = 0  # per pp rank (dualpipev's warm-up fills both chunks: 2)
    grouped: bool = False  # microbatches go through the chunks in groups of pp
    searched: tuple[int, ...] = (1,)  # chunks per rank the planner's search tries
    experts_only: bool = False  # the search tries it for MoE models only

    def virtual(self, virtual_stages: int) -> int:
        """Chunks per rank with ``schedule.virtual_stages``."""
        return self.chunks or virtual_stages


# The order: how the kinds are listed, and the planner's preference among equal predictions.
REGISTRY: dict[str, Kind] = {k.name: k for k in (
    Kind("1f1b", a.one_f_one_b),
    Kind("gpipe", a.gpipe, in_flight=lambda pp, m: 1 if pp == 1 else m),
    Kind("zb-h1", a.zb_h1, split=True, fill=3),
    Kind("zbv", a.zbv, style="v", chunks=2, split=True, fill=6),
    Kind("dualpipev", a.dualpipev, style="v", chunks=2, fill=3,
         in_flight=lambda pp, m: pp + 0.5, flight_everywhere=True, fb_pairs=True,
         min_microbatches=2, experts_only=True),
    Kind("interleaved", a.interleaved, chunks=0, grouped=True, searched=(2, 4)),
)}
KINDS = tuple(REGISTRY)  # the names as shipped; code that must see added entries reads REGISTRY


def kind_of(name: str) -> Kind:
    """The registry's entry; ValueError naming the valid kinds."""
    if name not in REGISTRY:
        raise ValueError(f"schedule.kind={name!r}; valid: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def virtual_of(name: str, virtual_stages: int) -> int:
    """Chunks per pp rank of schedule ``name`` with ``schedule.virtual_stages``."""
    return kind_of(name).virtual(virtual_stages)


def virtual_stages(cfg) -> int:
    """Chunks per pp rank of a config."""
    return virtual_of(cfg.schedule.kind, cfg.schedule.virtual_stages)


def layer_ranges(cfg) -> list[range]:
    """The layers of each of the ``pp * v`` virtual stages of a config: balanced, or cut at
    ``schedule.boundaries`` ("3,6": the first layer of stages 1, 2)."""
    s = cfg.schedule
    v = virtual_stages(cfg)
    text = s.boundaries.strip()
    try:
        cuts = [int(x) for x in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"schedule.boundaries={text!r}: expected layer numbers like "
                         "\"3,6\"") from None
    try:
        return placement.partition(cfg.model.n_layers, cfg.topology.pp * v, cuts)
    except ValueError as e:
        raise ValueError(f"schedule.boundaries={text!r}: {e}") from None


def style_of(name: str) -> str:
    """How schedule ``name`` places virtual stages on pp ranks: ``"loop"`` or ``"v"``."""
    return kind_of(name).style


def check_fits(kind: str, pp: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError with the arithmetic when the microbatch count cannot run ``kind``."""
    k = kind_of(kind)
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual} "
                         "must all be >= 1")
    if k.chunks and virtual != k.chunks:
        free = ", ".join(repr(n) for n, e in REGISTRY.items() if not e.chunks)
        raise ValueError(
            f"schedule.kind={kind!r} holds two stages per rank in a V; virtual_stages="
            f"{virtual} must be 2" if k.style == "v" else
            f"schedule.kind={kind!r} holds one stage per rank; virtual_stages={virtual} "
            f"needs schedule.kind={free}")
    if microbatches < k.min_microbatches * pp:
        raise ValueError(
            f"schedule {kind!r} needs at least {k.min_microbatches}*pp = "
            f"{k.min_microbatches * pp} microbatches per step (its warm-up fills both chunks "
            f"of the V), but there are {microbatches}; raise train.global_batch_size "
            "(microbatches = global_batch_size / (dp * micro_batch_size)), lower "
            "train.micro_batch_size, or use schedule.kind='zbv'")
    if k.grouped and virtual > 1 and microbatches % pp:
        raise ValueError(
            f"schedule {kind!r} sends microbatches through the chunks in groups of "
            f"pp={pp}, but there are {microbatches} microbatches ({microbatches} % {pp} = "
            f"{microbatches % pp}); use a multiple of {pp} (train.global_batch_size = "
            "microbatches * dp * micro_batch_size) or schedule.kind='1f1b'/'zb-h1'")


def compute_order(kind: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per rank, the F/B/W actions in execution order (no transfers yet)."""
    check_fits(kind, pp, microbatches, virtual)
    order = REGISTRY[kind].order
    return [order(pp, microbatches, r, virtual) for r in range(pp)]


def build(kind: str, pp: int, microbatches: int, virtual: int | None = None,
          forward_only: bool = False) -> Schedule:
    """The schedule ``kind`` for ``pp`` ranks, ``microbatches`` per step and ``virtual``
    chunks per rank (default: the kind's; those with ``chunks = 0``: 1). Pure; raises
    ValueError when it does not fit.

    ``forward_only``: each rank's forwards in the kind's order, without ``B``/``W`` (an
    evaluation pass: same placement, same links and tags). Dropping actions from a sound
    order only removes waits, so the forward-only order cannot deadlock either."""
    if virtual is None:
        virtual = kind_of(kind).virtual(1)
    orders = compute_order(kind, pp, microbatches, virtual)
    if forward_only:
        orders = [[x for x in o if x.kind == "F"] for o in orders]
    if virtual == 1:
        orders = [[Action(x.kind, x.microbatch) for x in o] for o in orders]
    ranks = with_comm(orders, pp, virtual, style_of(kind))
    return Schedule(kind, pp, virtual, microbatches, tuple(tuple(r) for r in ranks),
                    forward_only, style_of(kind))


def from_config(cfg, microbatches: int) -> Schedule:
    """The schedule a config asks for (``cfg.schedule``, ``cfg.topology.pp``)."""
    return build(cfg.schedule.kind, cfg.topology.pp, microbatches, virtual_stages(cfg))
