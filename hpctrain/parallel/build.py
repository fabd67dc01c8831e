"""Turn the model description into this rank's pieces, with communication inserted: the
layers of its pipeline stage(s), tensor-parallel ops, the context-parallel ring, expert
exchange, initialised exactly as the same parameters of a one-rank model."""

from __future__ import annotations

from ..comm import gpu
from ..config import Config
from ..model import DecoderStage, LocalOps, init_parameters
from .pipeline import chunks_of_rank, layer_ranges, style_of, virtual_stages


def tp_ops(cfg: Config, topo):
    """The tensor-parallel communication the model calls (identities when tp == 1)."""
    if topo.tp_size == 1:
        return LocalOps()
    from .tensor import TensorParallelOps

    return TensorParallelOps(topo.tp_comm, cfg.topology.sequence_parallel)


def build_model(cfg: Config, topo) -> list[DecoderStage]:
    """This rank's model chunks (one per virtual stage it holds), initialised identically
    to the same parameters of a one-rank model."""
    v = virtual_stages(cfg)
    S = topo.pp_size * v
    ranges = layer_ranges(cfg)  # balanced, or at schedule.boundaries
    ops = tp_ops(cfg, topo)
    context = None
    if topo.cp_size > 1 and cfg.topology.cp_kind == "ulysses":
        from .ulysses import UlyssesContext

        context = UlyssesContext(topo.cp_comm)
    elif topo.cp_size > 1:
        from .ring_attention import RingContext

        context = RingContext(topo.cp_comm)
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
