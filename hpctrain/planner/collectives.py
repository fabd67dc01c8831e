"""What collectives cost (no MPI): the alpha-beta formulas, and the communication a
microbatch's passes issue on one pp rank (tp, ep, the cp ring, ZeRO-3 gathers).

Every collective the passes issue (from the model's autograd functions and hooks) costs the
link's alpha-beta time plus ``Cluster.call_overhead_s``: the fixed time around each call
(Python and torch dispatch, the autograd function, on a shared machine the wait until the
peers are scheduled), which ``plan --calibrate`` measures as the layout issues its tp
all-reduces and is 0 in the published descriptions. Calls counted per layer and pass:

- **tp**: without sequence parallelism 2 all-reduces of one ``(B, T/cp, C)`` activation
  (``exit_tp`` forward, ``enter_tp`` backward); with it 4 calls, an all-gather and a
  reduce-scatter for each (the same ring volume, twice the calls); the vocabulary-parallel
  ends add 4 calls per microbatch: the embedding's all-reduce forward (first stage), the
  head's input gradient and the loss's max and sums (last stage);
- **ep**, per MoE layer: forward the routing counts (gathered over dp, exchanged over ep)
  and the dispatch and combine all-to-alls of ``top_k`` activations; backward the two
  all-to-alls;
- **cp**: :func:`context_exposed` (the ring, Ulysses, the hybrid); **ZeRO-3**:
  :func:`zero3_exposed`.

And what the gradient hooks and the dp reduction see: a rank's parameter tensors in the
model's order (:func:`rank_sizes`, from the modules built on the meta device) and the
buckets ``parallel/grad_sync/interface.py`` cuts from them (:func:`buckets`).
"""

from __future__ import annotations

import functools
import math

from ..config import Config, cp_factors, shard_size
from ..parallel.grad_sync.interface import cut
from .cluster import Cluster, Link
from .memory import DTYPE_BYTES


def allreduce(n: float, d: int, link: Link, algo: str = "ring", k: int = 1,
              intra: Link | None = None, flows: int = 1) -> float:
    """Seconds of an all-reduce of ``n`` bytes over ``d`` ranks (``k`` of them per node),
    while ``flows`` such groups cross each node's ``link`` at once (hierarchical: each of
    them as ``k`` rings of ``n/k``; :meth:`Link.carrying`).

    On a link a node's ranks share (``ports``), a flat all-reduce is priced by the bytes that
    leave each node, ``2 (N-1)/N n`` for ``N`` nodes, the least any algorithm sends, over
    the ports its ``k`` ranks can fill: what MPI's large all-reduce sends there
    (``benchmarks.crossing``: 1.00x the message out of each of 2 nodes), and what the
    hierarchical one costs on the same link."""
    if d <= 1 or n <= 0:
        return 0.0
    if algo == "hierarchical" and intra is not None and 1 < k < d and d % k == 0:
        return 2 * scatter(n, k, intra) + allreduce(n / k, d // k, link, "ring",
                                                    flows=flows * k)
    if algo == "ring" and link.ports and 1 < k < d and d % k == 0:
        nodes, rate = d // k, link.bandwidth * min(link.ports, flows * k) / flows
        return 2 * (d - 1) * link.latency + 2 * (nodes - 1) / nodes * n / rate
    link = link.carrying(flows)
    if algo == "tree":
        return 2 * math.ceil(math.log2(d)) * link.latency + 2 * n / link.bandwidth
    return 2 * (d - 1) * link.latency + 2 * (d - 1) / d * n / link.bandwidth


def summed(n: float, d: int, algo: str = "ring", k: int = 1) -> float:
    """Elements of ``n`` a rank adds in an all-reduce over ``d`` ranks (``k`` per node): the
    ring's reduce-scatter ``(d-1)/d n``; hierarchical: inside the node, then across on
    ``n/k``."""
    if d <= 1:
        return 0.0
    if algo == "hierarchical" and 1 < k < d and d % k == 0:
        return (k - 1) / k * n + summed(n / k, d // k)
    return (d - 1) / d * n


def scatter(n: float, d: int, link: Link) -> float:
    """A ring reduce-scatter (or all-gather, or all-to-all) of ``n`` bytes over ``d`` ranks."""
    if d <= 1 or n <= 0:
        return 0.0
    return (d - 1) * link.latency + (d - 1) / d * n / link.bandwidth


def tp_ep_costs(cfg: Config, cluster: Cluster, links: dict, w: dict) -> dict:
    """Seconds per microbatch on a pp rank with work ``w`` (``cost.rank_work``): tp per
    pass (forward and backward issue as many), ep forward and ep backward."""
    m, t, tr = cfg.model, cfg.topology, cfg.train
    o = cluster.call_overhead_s
    tokens = tr.micro_batch_size * tr.seq_len // t.cp
    act = tokens * m.d_model * DTYPE_BYTES[m.dtype]
    tp = 0.0
    if t.tp > 1:
        link = links["tp"]
        layer = (4 * (o + scatter(act, t.tp, link)) if t.sequence_parallel
                 else 2 * (o + allreduce(act, t.tp, link)))
        # per pass on average: the embedding's all-reduce (forward only), the head's input
        # gradient (backward) and the loss's max and sums (forward)
        ends = (0.5 * w["first"] + 1.5 * w["last"]) * (o + allreduce(tokens * 8, t.tp, link))
        tp = layer * w["layers"] + ends
    ep_f = ep_b = 0.0
    if t.ep > 1 and m.num_experts and w["moe"]:
        link = links["ep"]
        one = o + scatter(act * m.top_k, t.ep, link)
        counts = 8 * m.num_experts
        small = (o + scatter(counts * t.ep, t.ep, link)) + \
            (o + scatter(counts * t.dp, t.dp, links["dp"]))
        ep_f, ep_b = w["moe"] * (2 * one + small), w["moe"] * 2 * one
    return {"tp": tp, "ep_f": ep_f, "ep_b": ep_b}


def ring_exposed(cfg: Config, cluster: Cluster, link: Link, rate: float, u: int = 1,
                 r: int = 0) -> tuple[float, float]:
    """Context parallelism: (forward s, backward s) per layer and microbatch of the ring
    attention's K/V transfer *not* hidden behind the attention compute it overlaps with,
    for a ring of ``r`` ranks (0: cp) over ``h/u`` heads of ``T/r`` tokens each (the
    hybrid's rings: ``u`` ranks per Ulysses group). A hop (one call: ``call_overhead_s`` +
    the link's time) moves one stacked K/V block, ``2 B (T/r) kv_heads/(tp u) hd`` elements
    (float32 for 16-bit models, as ``parallel/ring_attention.py`` computes); a ring step
    computes the scores of ``(T/r)^2 / 2`` query-key pairs (the causal load balancing gives
    every step the same work). Forward: r-1 hops, each behind one step. Backward: r-1
    steps each pass the K/V block and a K/V gradient block (2 hops) behind the step's
    backward (2x its forward); the last gradient hop to the block's owner is exposed."""
    m, t, tr = cfg.model, cfg.topology, cfg.train
    r = r or t.cp
    if r <= 1:
        return 0.0, 0.0
    ps = DTYPE_BYTES[m.dtype]
    local = tr.seq_len // r
    hop = cluster.call_overhead_s + link.p2p(
        2 * tr.micro_batch_size * local * m.kv_heads * m.head_dim // (t.tp * u)
        * (4 if ps == 2 else ps))
    step = 2 * 2 * m.n_heads * m.head_dim / (t.tp * u) * local * local / 2 \
        * tr.micro_batch_size / rate
    return (r - 1) * max(0.0, hop - step), (r - 1) * max(0.0, 2 * hop - 2 * step) + hop


def ulysses_exposed(cfg: Config, cluster: Cluster, link: Link, u: int = 0) -> float:
    """Ulysses (``parallel/ulysses.py``): seconds per layer and pass (forward and backward
    alike) of its all-to-alls over ``u`` ranks (0: cp), none hidden: q, k, v to heads and
    the output back (the backward: the same four with gradients), each ``(u-1)/u`` of a
    ``B (T/cp) heads/tp hd`` tensor (kv heads for k and v) over the link, plus one call
    each."""
    m, t, tr = cfg.model, cfg.topology, cfg.train
    u = u or t.cp
    if u <= 1:
        return 0.0
    elems = tr.micro_batch_size * tr.seq_len // t.cp * m.head_dim // t.tp
    n = (2 * m.n_heads + 2 * m.kv_heads) * elems * DTYPE_BYTES[m.dtype]
    return 4 * cluster.call_overhead_s + scatter(n, u, link)


def context_exposed(cfg: Config, cluster: Cluster, links: dict, rate: float,
                    share: float) -> tuple[float, float]:
    """(forward s, backward s) per layer and microbatch of context parallelism
    (``topology.cp_kind``): the ring (:func:`ring_exposed` plus ``ring_overhead_s``, the
    ring's own work beyond its FLOPs, once forward and twice backward), Ulysses
    (:func:`ulysses_exposed`), or the hybrid: Ulysses over ``u`` ranks then rings of
    ``cp/u`` (``config.cp_factors`` with the cluster's ranks per node), the all-to-alls on
    the node's link when ``tp*u`` ranks fill nodes evenly (ranks packed by node), the
    rings on the cp link."""
    t = cfg.topology
    if t.cp <= 1:
        return 0.0, 0.0
    u, r = {"ring": (1, t.cp), "ulysses": (t.cp, 1)}.get(t.cp_kind) or cp_factors(
        t, cfg.model.n_heads, cfg.model.kv_heads, cluster.ranks_per_node)
    packed = t.cp_kind == "hybrid" and cfg.experimental.placement == "auto"
    inner = (cluster.intra if packed and cluster.ranks_per_node % (t.tp * u) == 0
             else links["cp"])
    a2a = ulysses_exposed(cfg, cluster, inner, u)
    ring_f, ring_b = ring_exposed(cfg, cluster, links["cp"], rate, u, r)
    own = cluster.ring_overhead_s / share if r > 1 else 0.0
    return a2a + ring_f + own, a2a + ring_b + 2 * own


def zero3_exposed(cfg: Config, cluster: Cluster, w: dict, link: Link, fwd: float,
                  bwd: float) -> tuple[float, float]:
    """A strategy that ``shards_parameters`` (ZeRO-3, ``parallel/grad_sync/sharded.py``):
    (forward s, backward s) per microbatch of the parameter all-gathers (every unit before
    its forward and again before its backward) and the gradient reduce-scatters (every unit,
    as its backward ends) over dp x cp, not hidden: each unit's gather is prefetched behind
    the previous unit's compute, except the first unit of each pass. One collective (its
    latencies and ``call_overhead_s``) per unit. HSDP: over the shard group (``link``: its
    link)."""
    from ..parallel.grad_sync.factory import strategy_of

    d = min(shard_size(cfg.topology), cfg.topology.dp * cfg.topology.cp)
    if not strategy_of(cfg).shards_parameters or d <= 1:
        return 0.0, 0.0
    ps = DTYPE_BYTES[cfg.model.dtype]
    gs = 8 if cfg.model.dtype == "float64" else 4
    u = w["units"]
    lat = u * ((d - 1) * link.latency + cluster.call_overhead_s)
    gather = lat + (d - 1) / d * w["params"] * ps / link.bandwidth
    reduce = lat + (d - 1) / d * w["params"] * gs / link.bandwidth
    first, rest = gather / u, gather * (u - 1) / u
    return first + max(0.0, rest - fwd), first + max(0.0, rest + reduce - bwd)


# -- parameter tensors: gradient hooks and reduction buckets ------------------------------
@functools.lru_cache(maxsize=64)
def parameter_tensors(m) -> dict:
    """Element counts of the parameter tensors (each has a gradient hook), in the model's
    order: ``dense`` / ``moe`` a block's, ``(first, last)`` a stage's own tensors before
    and after its blocks (the model's modules built on the meta device)."""
    import torch

    from ..model import DecoderStage

    def sizes(i: int, first: bool, last: bool) -> tuple:
        with torch.device("meta"):
            named = list(DecoderStage(m, [i], first=first, last=last).named_parameters())
        k = next(j for j, (n, _) in enumerate(named) if n.startswith("blocks."))
        ends = [(j < k, p.numel()) for j, (n, p) in enumerate(named)
                if not n.startswith("blocks.")]
        return (tuple(p.numel() for n, p in named if n.startswith("blocks.")),
                tuple(e for pre, e in ends if pre), tuple(e for pre, e in ends if not pre))
    dense = next((i for i in range(m.n_layers) if not m.moe_layer(i)), None)
    moe = next((i for i in range(m.n_layers) if m.moe_layer(i)), None)
    i = 0 if dense is None else dense
    out = {"dense": () if dense is None else sizes(i, False, False)[0],
           "moe": () if moe is None else sizes(moe, False, False)[0]}
    out.update({(f, la): sizes(i, f, la)[1:] for f in (False, True) for la in (False, True)})
    return out


def rank_sizes(cfg: Config, stages: list, ranges: list) -> list[int]:
    """Element counts of a pp rank's parameter tensors in the order its chunks hold them
    (a matrix's split over tp)."""
    m, t = cfg.model, cfg.topology
    n = parameter_tensors(m)
    out = []
    for s in stages:
        pre, post = n[(s == 0, s == len(ranges) - 1)]
        out += [*pre, *(e for i in ranges[s] for e in n["moe" if m.moe_layer(i) else "dense"]),
                *post]
    return [e // t.tp if e > m.d_model else e for e in out]


def buckets(sizes: list, limit: float) -> int:
    """How many reduction buckets the gradient sync cuts from tensors of ``sizes`` bytes (in
    the model's order): ``parallel/grad_sync/interface.py``'s :func:`cut`."""
    return len(cut(sizes, limit))
