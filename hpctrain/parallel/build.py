"""Turn the model description into this rank's pieces, with communication inserted: the
layers of its pipeline stage(s), tensor-parallel ops, the context-parallel ring, expert
exchange, initialised exactly as the same parameters of a one-rank model."""

from __future__ import annotations

from ..comm import gpu
from ..config import Config
from ..model import DecoderStage, LocalOps, init_parameters
from ..pipeline.placement import chunks_of_rank
from ..pipeline.schedules import layer_ranges, style_of, virtual_stages


def tp_ops(cfg: Config, topo):
    """The tensor-parallel communication the model calls (identities when tp == 1)."""
    if topo.tp_size == 1:
        return LocalOps()
    from .tensor import TensorParallelOps

    return TensorParallelOps(topo.tp_comm, cfg.topology.sequence_parallel)


def context_of(cfg: Config, topo):
    """The context-parallel attention the model calls (None when cp == 1): ring, Ulysses
    or hybrid (``topology.cp_kind``). Collective over the world for hybrid."""
    kind = cfg.topology.cp_kind
    if topo.cp_size == 1:
        return None
    if kind == "ulysses":
        from .ulysses import UlyssesContext

        return UlyssesContext(topo.cp_comm)
    if kind == "ring":
        from .ring_attention import RingContext

        return RingContext(topo.cp_comm)
    from ..config import cp_factors
    from ..model.families import family_of
    from ..topology import context_groups
    from .hybrid import HybridContext

    m = cfg.model
    node = topo.node_ranks() if not cfg.topology.cp_ulysses else 0
    u, _ = cp_factors(cfg.topology, m.n_heads, family_of(m).kv_heads(m), node)
    return HybridContext(topo.cp_comm, *context_groups(topo, u))


def build_model(cfg: Config, topo) -> list[DecoderStage]:
    """This rank's model chunks (one per virtual stage it holds), initialised identically
    to the same parameters of a one-rank model."""
    v = virtual_stages(cfg)
    S = topo.pp_size * v
    ranges = layer_ranges(cfg)  # balanced, or at schedule.boundaries
    ops = tp_ops(cfg, topo)
    context = context_of(cfg, topo)
    ffn_factory = None
    if cfg.model.num_experts:
        from .moe_exchange import ffn_factory as make

        ffn_factory = make(cfg.model, topo, ops)
    chunks = [
        DecoderStage(cfg.model, ranges[s], first=(s == 0), last=(s == S - 1), ops=ops,
                 ffn_factory=ffn_factory, context=context)
        for s in chunks_of_rank(topo.pp_rank, topo.pp_size, v, style_of(cfg.schedule.kind))
    ]
    init_parameters(chunks, cfg.train.seed, topo.tp_size, topo.tp_rank, topo.ep_size,
                    topo.ep_rank)
    device = gpu.device_for(cfg.model.device, topo.local_rank)
    return [c.to(device) for c in chunks]  # Module.to keeps the Parameter objects (p.hp)


def named_parameters(chunks) -> list:
    """(global name, parameter) for every parameter this rank holds."""
    out = []
    for c in chunks:
        out += list(c.named_parameters())
    return out
