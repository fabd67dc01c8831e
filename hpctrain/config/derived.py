"""Quantities a configuration implies beyond its keys: microbatches per step, the ZeRO shard
group's size, the factoring of context parallelism. Plain functions of the config's
dataclasses."""

from __future__ import annotations

import math


def microbatches(cfg) -> int:
    t = cfg.train
    return t.global_batch_size // (cfg.topology.dp * t.micro_batch_size)


def shard_size(tcfg) -> int:
    """Ranks of a ZeRO shard group: ``topology.shard_within`` as a size, else all the replicas
    of a parameter, dp x cp (``"node"``: known under MPI or from a cluster description)."""
    w = tcfg.shard_within
    return int(w) if w.isdigit() and int(w) >= 1 else tcfg.dp * tcfg.cp


def cp_factors(tcfg, heads: int, kv_heads: int,
               node_ranks: int = 0) -> tuple[int, int]:
    """Hybrid context parallelism: (u, r), ``cp = u * r`` (u ranks per Ulysses group, r per
    ring; ``topology.context_groups``). ``topology.cp_ulysses`` when set; else the first of
    :func:`ulysses_degrees`."""
    u = tcfg.cp_ulysses or ulysses_degrees(tcfg.cp, tcfg.tp, heads, kv_heads, node_ranks)[0]
    return u, tcfg.cp // u


def ulysses_degrees(cp: int, tp: int, heads: int, kv_heads: int, node_ranks: int = 0) -> list:
    """The divisors u of cp, largest first and 1 last, that each tp rank's query and kv
    heads divide by and, with ``node_ranks`` (ranks per node; 0: unknown), whose ``tp * u``
    ranks fill nodes evenly."""
    return [u for u in range(cp, 1, -1) if cp % u == 0 and heads // tp % u == 0
            and kv_heads // tp % u == 0 and (not node_ranks or node_ranks % (tp * u) == 0)] + [1]


def lr_at(step: int, ocfg, total_steps: int) -> float:
    """The learning rate of ``step`` under ``ocfg`` (an ``OptimConfig``): linear warmup
    over ``warmup_steps``, then cosine decay to ``min_lr`` at the horizon
    ``decay_steps`` (0: ``total_steps``, which a resumed run takes from its checkpoint:
    ``checkpoint.lineage.decay_horizon``). ``step`` counts from 0. From the horizon on the
    rate is ``min_lr``, also when the warmup has not ended there."""
    decay = ocfg.decay_steps or total_steps
    if step >= decay:
        return ocfg.min_lr
    if ocfg.warmup_steps > 0 and step < ocfg.warmup_steps:
        return ocfg.lr * (step + 1) / ocfg.warmup_steps
    progress = (step - ocfg.warmup_steps) / (decay - ocfg.warmup_steps)  # in [0, 1)
    return ocfg.min_lr + 0.5 * (ocfg.lr - ocfg.min_lr) * (1 + math.cos(math.pi * progress))
