"""Pipeline partition: which layers live on which (virtual) stage.

Stage ``s`` of ``S = pp * v`` virtual stages is held by pp rank ``s % pp`` (the interleaved
placement, style ``"loop"``: rank r holds chunks r, r+pp, r+2pp, ...), or, for the V-shaped
schedules (style ``"v"`` in their registry entry, two chunks per rank), rank r holds stages r and
2pp-1-r, so the model goes down the ranks and back up (rank pp-1 holds the two middle
stages, rank 0 the first and the last). The first virtual stage owns the embedding, the
last the final norm, head and loss.
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


def chunks_of_rank(pp_rank: int, pp: int, virtual: int, style: str = "loop") -> list[int]:
    """Virtual stage indices held by one pp rank, in model order (chunk k is the k-th)."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def rank_of_stage(stage: int, pp: int, style: str = "loop") -> int:
    """The pp rank that holds virtual stage ``stage`` (inverse of :func:`chunks_of_rank`)."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def activation_shape(cfg, topo) -> tuple[int, int, int]:
    """What crosses a stage boundary, in training and evaluation alike: (micro batch size,
    this rank's tokens, d_model). The tokens are ``seq_len / cp``, divided by tp too under
    sequence parallelism (each tp rank holds a slice of the sequence between blocks)."""
    T = cfg.train.seq_len // topo.cp_size
    if cfg.topology.sequence_parallel:
        T //= topo.tp_size
    return (cfg.train.micro_batch_size, T, cfg.model.d_model)
