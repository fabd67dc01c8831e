"""The cost model: one step's time per rank from a config and a cluster description (no MPI).

Per pp rank and microbatch (the most loaded rank sets the pace):

- **compute**: the rank's model FLOPs (``planner/flops.py`` per layer: its layers, the head
  on the last stage, split over tp) at ``peak x efficiency x compute_share`` (the share is 1
  for a one-rank run); backward 2x forward, +1 forward with ``model.recompute = "full"``,
  + the attention core's forward with ``"selective"`` (:func:`core_redo_flops`); plus
  ``overhead_s`` per layer and pass and ``pass_overhead_s`` per stage (chunk) and pass,
  over the share too (host work, slowed alike; so are the hook and ring overheads);
- **hooks** (where the gradient-sync strategy hooks gradients, ``GradSync.hooks``: ZeRO
  2/3, ``optim.overlap``, 16-bit models): ``hook_overhead_s`` per parameter tensor and
  microbatch, in the backward;
- **tp**: 2 all-reduces (with sequence parallelism 2 all-gathers + 2 reduce-scatters, the
  same ring volume in twice the calls) of one ``(B, T, C)`` activation per layer forward, as
  many backward (again to recompute), plus the small ones of the vocabulary-parallel
  embedding, head and loss; every call also costs ``call_overhead_s``
  (``planner/collectives.py``);
- **ep**: dispatch + combine all-to-alls of ``top_k`` activations per MoE layer, both ways,
  and the routing counts forward;
- **pp**: one activation per microbatch per stage boundary, as the simulator's latency;
- **cp**: every rank computes ``seq_len / cp`` tokens (activations, tp/ep/pp messages are
  per ``T/cp`` too); the ring attention's K/V transfers over the cp link, exposed beyond
  the attention compute they overlap with (``collectives.ring_exposed``), plus
  ``ring_overhead_s`` per layer and pass (the ring attention's own work beyond its FLOPs);
  with ``cp_kind = "ulysses"`` instead four all-to-alls per layer and pass, none hidden
  (``collectives.ulysses_exposed``); ``"hybrid"``: the all-to-alls over a Ulysses group
  (on the node's link) and rings of ``cp/u`` ranks over ``h/u`` heads
  (``collectives.context_exposed``);
- **zero3** (a strategy that ``shards_parameters``: ZeRO-3): the per-unit parameter
  all-gathers (forward and again backward) and gradient reduce-scatters over dp x cp,
  exposed beyond the pass's compute
  (``collectives.zero3_exposed``); in the passes, hence in the pipeline;
- **split backward** (zb-h1, zbv; dualpipev's cool-down): B + W cost ``split_b + split_w``
  backwards (the description's; hpctrain's B is all but the weight matmuls, W those matmuls).

The pipeline's makespan comes from ``pipeline/simulate.py`` fed with these per-rank costs
(bubble included), or the closed form ``(m + (p-1)/v)(F+B)`` above ``SIMULATED_MAX``
chunk-microbatches (zbv's V placement and bubble included). Then per step: the gradient
reduction over the replicas dp x cp as the gradient-sync strategy the config selects prices
it (``GradSync.dp_seconds`` over :class:`DpNet`; ZeRO 0: all-reduce of float32 gradients,
bfloat16 with ``optim.grad_comm_dtype``; 1: reduce-scatter + all-gather of parameters; 2:
reduce-scatter per microbatch; one latency per ``optim.bucket_mb`` bucket); FSDP of the
published runs (``Extras.fsdp``): two all-gathers of parameters and one reduce-scatter per
microbatch; the reductions a gradient hook posts (``GradSync.posts``: ZeRO-2's and
overlap's) ``post_overhead_s`` each; exposed beyond the backward it overlaps with
(``GradSync.overlapped``: ``optim.overlap``; FSDP prefetch overlaps with all compute); the
optimizer step (bytes of parameters, gradients and Adam state, divided as the strategy
shards it, over ``memory_bandwidth``); ``step_overhead_s``; a
checkpoint's bytes over the nodes' ``checkpoint_bandwidth``, amortised over
``checkpoint.every`` (or the run's steps).

Collectives (alpha-beta, per rank): ring all-reduce ``2(d-1)a + 2(d-1)/d N b``; tree
``2 log2(d) a + 2 N b``; hierarchical: reduce-scatter inside the node, a ring all-reduce of
``N/k`` across nodes, all-gather inside (the algorithm of ``HierarchicalBuckets``,
``topology.dp_reduction = "hierarchical"``). The link of an axis is the inter-node one when
any of its groups spans two nodes (``topology.crossing``, ranks packed ``ranks_per_node`` per
node). HSDP
(``topology.shard_within``): the ZeRO collectives over the shard group on its link, plus
the shards' all-reduce across groups (``planner/hsdp.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field

from ..config import Config, microbatches, shard_size
from ..model.families import family_of
from ..parallel.grad_sync.factory import decided, strategy_of
from ..parallel.grad_sync.interface import wire_bytes
from ..pipeline.schedules import kind_of, style_of
from . import hsdp
from .cluster import Cluster, Link
from .collectives import (
    allreduce,
    buckets,
    context_exposed,
    rank_sizes,
    scatter,
    summed,
    tp_ep_costs,
    zero3_exposed,
)
from .flops import mtp_flops, train_flops_per_token
from .memory import DTYPE_BYTES, Estimate, estimate, stage_params

SIMULATED_MAX = 256  # chunk-microbatches per rank above which the closed form is used
# zb-h1/zbv split each backward into B (all but the weight matmuls) and W (their weight
# gradients; model/weight_grad.py): the description's split_b / split_w (``plan
# --calibrate`` measures them); the defaults are the shares of one backward on one pp=4
# stage of the small benchmark model (B + W exceeds one backward by the Python of the
# deferred matmuls; docs/decisions.md).
SPLIT_B, SPLIT_W = 0.74, 0.38


@dataclass(frozen=True)
class Extras:
    """What a published model has that hpctrain's config cannot say (plain numbers)."""

    n_kv_heads: int = 0  # grouped-query attention; 0: as many as n_heads
    gated_mlp: bool = False  # SwiGLU: three C x F matrices (Llama)
    fsdp: bool = False  # FSDP as torchtitan runs it (hpctrain's own ZeRO-3: optim.zero=3)
    attention_full: bool = False  # the kernel computes the masked half of attention too


@dataclass
class Prediction:
    step_s: float
    parts: dict  # name -> seconds (compute ... checkpoint), see the module docstring
    tokens_per_s: float
    mfu: float
    memory: Estimate
    world: int
    bubble: float  # idle fraction of the pipeline's makespan
    links: dict = field(default_factory=dict)  # axis -> "intra" | "inter"

    @property
    def tokens_per_s_per_rank(self) -> float:
        return self.tokens_per_s / self.world


def equivalent(cfg: Config, ex: Extras) -> Config:
    """A GPT config with the same parameters and FLOPs per block as a GQA/SwiGLU model: the
    MLP width absorbs the smaller k/v projections and the third matrix."""
    m = cfg.model
    if not ex.n_kv_heads and not ex.gated_mlp:
        return cfg
    C, kv = m.d_model, ex.n_kv_heads or m.n_heads
    per_block = 2 * C * C + 2 * C * C * kv // m.n_heads + (3 if ex.gated_mlp else 2) * C * m.ffn_dim
    d_ff = (per_block - 4 * C * C) // (2 * C)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, d_ff=d_ff))


# -- links -------------------------------------------------------------------------------
def axis_links(cfg: Config, cluster: Cluster) -> dict[str, Link]:
    """Per axis, the link its groups use (inter-node as soon as one group spans nodes)."""
    t = cfg.topology
    world = t.dp * t.tp * t.pp * t.cp
    rpn = min(cluster.ranks_per_node, world)
    if world % rpn:
        raise ValueError(f"{world} ranks do not fill nodes of {cluster.ranks_per_node} "
                         f"ranks ({cluster.name})")
    if cfg.experimental.placement == "naive":
        from ..topology import crossing

        cross = {a: n > 0 for a, (n, _) in crossing(t, world // rpn, rpn, "naive").items()}
    else:
        cross = packed_crossing((t.pp, t.dp // t.ep, t.ep, t.cp, t.tp), rpn)
    # the replicas of a parameter are dp x cp (gradients, ZeRO shards): a dp x cp group
    # spans two nodes iff its dp or its cp sub-groups do (both are contiguous blocks)
    cross["dp"] = cross["dp"] or (t.cp > 1 and cross["cp"])
    return {axis: cluster.inter if c else cluster.intra for axis, c in cross.items()}


# as topology.AXIS_DIMS (dims: pp, dp_outer, ep, cp, tp)
AXIS_DIMS = {"tp": (4,), "cp": (3,), "ep": (2,), "dp": (1, 2), "pp": (0,)}


def packed_crossing(dims: tuple, rpn: int) -> dict[str, bool]:
    """:func:`_crossing_of`, cached (a search asks the same grids many times)."""
    return dict(_crossing_of(tuple(dims), rpn))


@functools.lru_cache(maxsize=4096)
def _crossing_of(dims: tuple, rpn: int) -> tuple:
    """Whether any group of each axis spans two nodes, ranks packed ``rpn`` per node in the
    grid's row-major order (``topology.crossing`` for ``placement = "auto"``, in O(groups)):
    a group's ranks lie between its first and last, so it crosses iff those two do."""
    strides = [1] * 5
    for k in (3, 2, 1, 0):
        strides[k] = strides[k + 1] * dims[k + 1]
    out = {}
    for axis, varying in AXIS_DIMS.items():
        span = sum((dims[k] - 1) * strides[k] for k in varying)
        fixed = [k for k in range(5) if k not in varying]
        out[axis] = span > 0 and any(
            base // rpn != (base + span) // rpn
            for base in (sum(c * strides[k] for c, k in zip(cs, fixed))
                         for cs in itertools.product(*(range(dims[k]) for k in fixed))))
    return tuple(out.items())


# -- per-rank work -----------------------------------------------------------------------
def layer_flops(cfg: Config, i: int, full: bool = False, terms=None) -> float:
    """Forward FLOPs per token of block ``i`` (``planner/flops.py``'s terms, ``terms`` when
    given; ``full``: the keys a causal mask hides are computed too, as attention without a
    fused kernel does)."""
    m, T = cfg.model, cfg.train.seq_len
    terms = terms or family_of(m).flop_terms(m, T if full else (T + 1) / 2)
    return terms.attention + (terms.moe_mlp if m.moe_layer(i) else terms.dense_mlp)


def rank_work(cfg: Config, full: bool = False) -> list[dict]:
    """Per pp rank: forward FLOPs per token on this rank (over tp), its layers, MoE layers,
    stages (chunks), parameter elements (unsharded) and tensors, and ZeRO-3 units (its
    blocks and its root, if any)."""
    from ..pipeline.placement import chunks_of_rank
    from ..pipeline.schedules import layer_ranges

    m, t = cfg.model, cfg.topology
    ranges, T = layer_ranges(cfg), cfg.train.seq_len
    S, terms = len(ranges), family_of(m).flop_terms(m, T if full else (T + 1) / 2)
    kinds = {(len(ranges[s]), s == 0, s == S - 1): 0 for s in range(S)}  # few distinct ones
    params_of, out = {k: stage_params(cfg, *k) for k in kinds}, []
    for r in range(t.pp):
        stages = chunks_of_rank(r, t.pp, S // t.pp, style_of(cfg.schedule.kind))
        layers = [i for s in stages for i in ranges[s]]
        flops = sum(layer_flops(cfg, i, full, terms) for i in layers)
        flops += 2 * m.d_model * m.vocab_size + mtp_flops(m, terms) if S - 1 in stages else 0
        moe = sum(1 for i in layers if m.moe_layer(i))
        first, last = 0 in stages, S - 1 in stages
        params = sum(params_of[len(ranges[s]), s == 0, s == S - 1] for s in stages)
        sizes = rank_sizes(cfg, stages, ranges)
        out.append({"flops": flops / t.tp, "layers": len(layers), "moe": moe,
                    "chunks": len(stages), "tensors": len(sizes), "sizes": sizes,
                    "first": first, "last": last, "params": params,
                    "units": len(layers) + (1 if first or last else 0)})
    return out


def pass_costs(cfg: Config, cluster: Cluster, links: dict, work: list[dict]
               ) -> list[tuple[float, float, dict]]:
    """Per pp rank of ``work`` (:func:`rank_work`): (forward s, whole backward s, {part: s}
    per microbatch); the communication inside the passes from ``planner/collectives.py``."""
    m, t, tr = cfg.model, cfg.topology, cfg.train
    share = cluster.compute_share if t.pp * t.dp * t.cp * t.tp > 1 else 1.0  # 1 rank: alone
    rate = cluster.peak(m.dtype) * cluster.efficiency * share
    tokens = tr.micro_batch_size * tr.seq_len // t.cp  # context parallelism: T/cp each
    ctx_f, ctx_b = context_exposed(cfg, cluster, links, rate, share)  # per layer
    split = (cluster.split_b + cluster.split_w - 1
             if kind_of(cfg.schedule.kind).split else 0.0)
    # the gradient sync's hooks move every parameter's gradient per microbatch
    hooked = strategy_of(cfg).hooks(cfg)
    # the overheads are the rank's own (CPU) work too: slowed by the share like its FLOPs
    hooks = cluster.hook_overhead_s / share if hooked else 0.0
    out = []
    for w in work:
        f = w["flops"] * tokens / rate
        over = (cluster.overhead_s * w["layers"] + cluster.pass_overhead_s * w["chunks"]) / share
        redo = 1 if m.recompute == "full" else 0
        c = tp_ep_costs(cfg, cluster, links, w)
        tp = c["tp"]
        cp_f, cp_b = ctx_f * w["layers"], (ctx_b + redo * ctx_f) * w["layers"]
        z_f, z_b = zero3_exposed(cfg, cluster, w, links.get("zero3", links["dp"]), f + over,
                                 2 * (f + over))
        back = (2 * (1 + split) + redo) * (f + over)  # split: B + W = split_b + split_w
        back += core_redo_flops(cfg) * w["layers"] * tokens / rate
        hk = hooks * w["tensors"]
        fwd = f + over + tp + c["ep_f"] + cp_f + z_f
        bwd = back + hk + tp * (1 + redo) + c["ep_b"] + redo * c["ep_f"] + cp_b + z_b
        out.append((fwd, bwd, {"compute": f + over + back, "hooks": hk,
                               "tp": tp * (2 + redo),
                               "ep": c["ep_f"] * (1 + redo) + c["ep_b"],
                               "cp": cp_f + cp_b, "zero3": z_f + z_b}))
    return out


def core_redo_flops(cfg: Config) -> float:
    """Forward FLOPs per token and layer on one rank that selective recompute replays in
    backward: the attention core, QK^T and AV (``planner/flops.py``), over tp; 0 for the
    other modes and with cp > 1 (ring attention recomputes its blocks either way)."""
    m, t = cfg.model, cfg.topology
    if m.recompute != "selective" or t.cp > 1:
        return 0.0
    return 2 * 2 * m.d_model * (cfg.train.seq_len + 1) / 2 / t.tp


# -- the step ----------------------------------------------------------------------------
def pipeline(cfg: Config, costs, p2p: float, simulated: bool = True,
             shares: tuple = (SPLIT_B, SPLIT_W)) -> tuple[float, float]:
    """(makespan s, bubble fraction) of one step's pipeline with per-rank pass costs: the
    simulator's, or (``simulated=False``, or too many microbatches) the closed form."""
    from ..pipeline.actions import deferred
    from ..pipeline.schedules import build, virtual_stages
    from ..pipeline.simulate import simulate

    t, s = cfg.topology, cfg.schedule
    M = microbatches(cfg)
    v = virtual_stages(cfg)
    busiest = max(f + b for f, b, _ in costs)
    if t.pp == 1:
        return M * busiest, 0.0
    if M * v > SIMULATED_MAX or not simulated:
        # zbv: only the fill, F/2 per stage; dualpipev: (pp-1)(F&B+B-3W) per chunk
        fill = (t.pp - 1) * busiest / (kind_of(s.kind).fill or v)  # the kind's closed form
        span = M * busiest + fill + 2 * (t.pp - 1) * p2p
        return span, fill / span
    sched = build(s.kind, t.pp, M, v)
    split = [deferred(acts) for acts in sched.ranks]  # the B's with a W

    def cost(rank, a):
        f, b, _ = costs[rank]
        if a.kind == "F":
            return f / v
        if a.kind in ("B", "W") and (a.microbatch, a.c) in split[rank]:  # measured shares
            return b * shares[a.kind == "W"] / sum(shares) / v
        return b / v if a.kind == "B" else 0.0

    res = simulate(sched, cost, latency=p2p)
    return res.makespan, res.bubble


@dataclass(frozen=True)
class DpNet:
    """The dp x cp reduction as a gradient-sync strategy prices it (``GradSync.dp_seconds``):
    ``d`` replicas on ``link`` (``k`` per node, ``intra`` inside one), shard groups of ``s``
    on ``shard_link`` (HSDP; else all ``d``), ``cross`` seconds of HSDP's all-reduce across
    groups, ``M`` microbatches, ``ps`` bytes per parameter, ``gs`` per gradient on the wire;
    ``flows`` groups cross each node's link at once (``Link.carrying``), ``sum_s`` seconds
    per element a rank adds in software (16-bit traffic: ``Cluster.sum16_s``)."""

    d: int
    s: int
    k: int
    M: int
    ps: int
    gs: int
    link: Link
    shard_link: Link
    intra: Link
    collective: str  # the cluster's all-reduce algorithm
    cross: float
    flows: int = 1
    sum_s: float = 0.0

    def allreduce(self, n: float, algo: str | None = None) -> float:
        """An all-reduce of ``n`` bytes over the ``d`` replicas (``algo``: the cluster's),
        with the software sums it adds."""
        algo = algo or self.collective
        adds = summed(n / self.gs, self.d, algo, self.k) * self.sum_s
        return adds + allreduce(n, self.d, self.link, algo, self.k, self.intra, self.flows)

    def scatter(self, n: float) -> float:
        """A reduce-scatter (or all-gather) of ``n`` bytes over a shard group."""
        return scatter(n, self.s, self.shard_link.carrying(self.flows))


def dp_time(cfg: Config, cluster: Cluster, links: dict, P: int, ex: Extras,
            nb: int) -> float:
    """Seconds of one step's gradient (and ZeRO parameter) traffic over dp, not overlapped
    (``nb``: the buckets the busiest rank reduces, :func:`buckets`): the strategy's
    (``GradSync.dp_seconds``), or FSDP's for a published run."""
    t = cfg.topology
    d = t.dp * t.cp  # the replicas of a parameter (gradients are summed over dp x cp)
    if d <= 1:
        return 0.0
    s, shard_link, replica_link = hsdp.groups(cfg, cluster, links)
    cross = hsdp.across(cfg, cluster, replica_link, P, nb)  # HSDP: shards across groups
    ps, gs = DTYPE_BYTES[cfg.model.dtype], wire_bytes(cfg)
    link = links["dp"]
    M = microbatches(cfg)
    if ex.fsdp:  # a gather forward, one backward, a reduce-scatter
        return M * (2 * scatter(P * ps, d, link) + scatter(P * gs, d, link))
    k = max(1, min(d, cluster.ranks_per_node // t.tp))
    flows = max(1, min(cluster.ranks_per_node, t.dp * t.tp * t.pp * t.cp) // k)
    sum_s = cluster.sum16_s if gs == 2 else 0.0
    net = DpNet(d, s, k, M, ps, gs, link, shard_link, cluster.intra, cluster.collective, cross,
                flows, sum_s)
    return strategy_of(cfg).dp_seconds(net, P, nb)


def predict(cfg: Config, cluster: Cluster, ex: Extras = Extras(),
            simulated: bool = True) -> Prediction:
    """The step time, its parts, tokens/s, MFU and memory of ``cfg`` on ``cluster``
    (``simulated=False``: the pipeline's closed form, for a quick first ranking)."""
    c = hsdp.on_cluster(equivalent(cfg, ex), cluster)  # shard_within "node" as a size
    t, m, tr = c.topology, c.model, c.train
    world = t.dp * t.tp * t.pp * t.cp
    links = axis_links(c, cluster)
    # overlap as a run decides it (optim.overlap_across_nodes; ZeRO-2/3 post from their
    # hooks whatever it says)
    progress, overlap = decided(c, links["dp"] is cluster.inter)
    if c.optim.zero < 2:
        c = dataclasses.replace(c, optim=dataclasses.replace(c.optim, overlap=overlap))
    links["zero3"] = hsdp.groups(c, cluster, links)[1]  # ZeRO-3's gathers: the shard groups
    work = rank_work(c, ex.attention_full)
    costs = pass_costs(c, cluster, links, work)
    ps = DTYPE_BYTES[m.dtype]
    act = tr.micro_batch_size * tr.seq_len // t.cp * m.d_model * ps
    p2p = links["pp"].p2p(act) if t.pp > 1 else 0
    span, bubble = pipeline(c, costs, p2p, simulated, (cluster.split_b, cluster.split_w))
    mem = estimate(c)
    P = mem.elements  # unsharded
    sync = strategy_of(c)
    M = microbatches(c)
    busiest = max(range(t.pp), key=lambda r: costs[r][0] + costs[r][1])
    parts = {k: M * v for k, v in costs[busiest][2].items()}
    parts["pp"] = span - sum(parts.values())  # bubble and transfers: what compute leaves
    nb = buckets([e * ps for e in work[busiest]["sizes"]], c.optim.bucket_mb * 2**20)
    dp = dp_time(c, cluster, links, P, ex, nb)
    window = span if ex.fsdp else (costs[busiest][1] if sync.overlapped(c) else 0.0)
    # reductions posted from the gradient hooks: post_overhead_s each, in the backward
    calls = sync.posts(c, nb, M) if t.dp * t.cp > 1 else 0
    spins = sync.spins(c, progress) and cluster.compute_share < 1
    parts["dp"] = exposed(dp, window, spins) + calls * cluster.post_overhead_s
    parts.update(_update_and_save(c, cluster, mem, P, ex))
    step = sum(parts.values())
    tokens = tr.global_batch_size * tr.seq_len
    mfu = train_flops_per_token(m, tr.seq_len) * tokens / (step * world * cluster.peak(m.dtype))
    if ex.fsdp:
        mem = _fsdp_memory(mem, t.dp, sync.zero_level)
    return Prediction(step, parts, tokens / step, mfu, mem, world, bubble,
                      {a: ("inter" if ln is cluster.inter else "intra")
                       for a, ln in links.items()})


def exposed(dp: float, window: float, spins: bool) -> float:
    """Seconds of the step's ``dp`` traffic not hidden by the backward ``window`` it overlaps
    with. A thread waiting inside MPI on a core its rank shares (``spins``: a progress
    thread where ranks outnumber cores) halves the backward's speed while the traffic
    lasts: the backward then takes ``window + min(dp, 2 window) / 2``."""
    if not spins:
        return max(0.0, dp - window)
    return max(dp - window, min(dp, 2 * window) / 2)


def _update_and_save(cfg: Config, cluster: Cluster, mem: Estimate, P: int,
                     ex: Extras) -> dict:
    """Optimizer step, per-step overhead and the amortised checkpoint, in seconds."""
    ps = DTYPE_BYTES[cfg.model.dtype]
    ss = 8 if cfg.model.dtype == "float64" else 4
    state = 2 * ss + (4 if ps == 2 else 0)
    t = cfg.topology
    n = P / (shard_size(t) if ex.fsdp else strategy_of(cfg).state_shards(cfg))
    optimizer = n * (2 * (ps + state) + ss) / cluster.memory_bandwidth
    world = t.dp * t.tp * t.pp * t.cp
    nodes = max(1, world // cluster.ranks_per_node)
    # one copy of the model and its optimizer state is written per save
    saved = P * cfg.topology.tp * cfg.topology.pp * (ps + state)
    every = cfg.checkpoint.every or (cfg.train.steps if cfg.checkpoint.save_final else 0)
    ckpt = saved / (cluster.checkpoint_bandwidth * nodes) / every if every else 0.0
    return {"optimizer": optimizer, "overhead": cluster.step_overhead_s, "checkpoint": ckpt}


def _fsdp_memory(mem: Estimate, dp: int, zero: int) -> Estimate:
    """FSDP (ZeRO-3) keeps 1/dp of parameters, gradients and state between uses (``zero``:
    the ZeRO level of the strategy ``mem`` was estimated for)."""
    undo = dp if zero else 1
    return dataclasses.replace(mem, params=mem.params // dp,
                               grads=mem.grads * undo // dp if zero < 2 else mem.grads,
                               optimizer=mem.optimizer * undo // dp)
