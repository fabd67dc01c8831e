"""Pipeline partition: which layers live on which (virtual) stage.

Stage ``s`` of ``S = pp * v`` virtual stages is held by pp rank ``s % pp`` (the interleaved
placement: rank r holds chunks r, r+pp, r+2pp, ...). The first virtual stage owns the
embedding, the last the final norm, head and loss.
"""

from __future__ import annotations


def partition(n_layers: int, stages: int, boundaries: list[int] | None = None) -> list[range]:
    """Split ``n_layers`` into ``stages`` contiguous ranges, balanced by layer count (the
    first ``n_layers % stages`` stages take one more), or at explicit ``boundaries``
    (the first layer of stages 1..S-1)."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    if boundaries:
        cuts = [0, *boundaries, n_layers]
        if len(cuts) != stages + 1 or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"boundaries {boundaries} do not cut {n_layers} layers into "
                             f"{stages} non-empty stages")
        return [range(a, b) for a, b in zip(cuts, cuts[1:])]
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def chunks_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Virtual stage indices held by one pp rank, in model order."""
    return [pp_rank + k * pp for k in range(virtual)]


def layer_ranges(cfg) -> list[range]:
    """The layers of each of the ``pp * v`` virtual stages of a config: balanced, or cut at
    ``schedule.boundaries`` ("3,6": the first layer of stages 1, 2)."""
    s = cfg.schedule
    v = s.virtual_stages if s.kind == "interleaved" else 1
    text = s.boundaries.strip()
    try:
        cuts = [int(x) for x in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"schedule.boundaries={text!r}: expected layer numbers like "
                         "\"3,6\"") from None
    try:
        return partition(cfg.model.n_layers, cfg.topology.pp * v, cuts)
    except ValueError as e:
        raise ValueError(f"schedule.boundaries={text!r}: {e}") from None
