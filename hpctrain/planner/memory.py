"""Memory per rank: the plan's estimate (no MPI, no allocation).

**Estimate** (:func:`estimate`): from the config alone, for the most loaded pipeline stage,

- parameters: this rank's elements (blocks of its stage, embedding/head on the first/last
  stage, split over tp; expert weights split over ep) x dtype size;
- parameters and gradients as the gradient-sync strategy the config selects holds them
  (``GradSync.memory``, ``parallel/grad_sync/``): gradients all float32 (float64 for
  float64; 16-bit models accumulate in float32 "main grads", their transient 16-bit
  ``p.grad`` is not counted): zero 0/1 a flat buffer; zero 1 also a reduced shard of 1/dp;
  zero 2 only the shard plus one staging bucket; zero 3 the shard plus one block's staging,
  and parameters divided by dp too, plus what is gathered at once (:func:`gathered`: the
  running unit and the prefetched one: two blocks, or a block and the embedding or head);
- optimizer state: Adam's two moments (+ a float32 master copy for 16-bit parameters),
  divided as the strategy shards it (``GradSync.state_shards``: dp under ZeRO);
- HSDP (``topology.shard_within``): "dp" above is the shard group's size, not dp x cp;
- activations: what autograd saves per microbatch, times the microbatches in flight on the
  first stage (pp=1: 1; 1f1b/zb-h1/zbv/interleaved: min(pp, microbatches); gpipe: all;
  dualpipev: pp + 1/2 on every rank, i.e. 2pp+1 microbatches of one of its two chunks).
  Full recompute keeps each block's input plus one block's activations during its backward;
  selective recompute keeps the attention core's inputs (q, k, v with kv heads), not its
  log-sum-exp nor the rotated and repeated keys (:func:`block_activation_bytes`).
  Context parallelism: every rank holds ``seq_len / cp`` tokens of each sequence, so all of
  these are per ``seq_len / cp`` tokens (:func:`local_tokens`).
The measurement is :mod:`hpctrain.telemetry.meter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config, cp_factors, microbatches
from ..model.families import family_of

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


# -- estimate --------------------------------------------------------------------------
def stage_params(cfg: Config, layers: int, first: bool, last: bool) -> int:
    """Parameter elements on one rank of a stage with ``layers`` blocks."""
    m, top = cfg.model, cfg.topology
    C, tp, family = m.d_model, top.tp, family_of(m)
    vocab_local = -(-m.vocab_size // tp)
    dense_mlp = family.mlp_params(m, tp)
    per_block = family.block_params(m, tp)
    n_moe = 0
    if m.num_experts:
        # experts are split over ep, not tp (each tp rank routes other tokens)
        expert = family.expert_params(m, top.ep, tp)
        n_moe = sum(1 for i in range(layers) if m.moe_layer(i))
        total = layers * per_block + n_moe * expert + (layers - n_moe) * dense_mlp
    else:
        total = layers * (per_block + dense_mlp)
    if first:
        total += vocab_local * C
    if last:
        total += C + (0 if m.tie_embeddings else vocab_local * C)
        for i in range(m.n_layers, m.n_layers + m.mtp_depth):  # multi-token prediction
            ffn = family.expert_params(m, top.ep, tp) if m.moe_layer(i) else dense_mlp
            total += per_block + ffn + 2 * C * C + 3 * C  # block, eh_proj, three norms
    return total


def _norm_bytes(T: int, C: int, ps: int) -> int:
    """RMSNorm + its output, per sequence: input, 1/rms, normalised, scaled. 16-bit inputs
    are normalised in float32 (a float32 copy and float32 1/rms)."""
    return T * (4 * C + 4 + 2 * C * ps) if ps == 2 else T * (3 * C * ps + ps)


def local_tokens(cfg: Config) -> int:
    """Tokens of each sequence on one rank: ``seq_len / cp`` (context parallelism)."""
    return cfg.train.seq_len // max(1, cfg.topology.cp)


# cp > 1: attention elements saved per token (C channels, kv: k and v with kv heads)
ATTENTION_SAVED = {"ring": lambda C, kv: 3 * C + kv, "ulysses": lambda C, kv: 6 * C,
                   "hybrid": lambda C, kv: 4 * C + kv}


def _attention_kind(cfg: Config) -> str:
    """The attention a cp rank runs: the hybrid with one ring is Ulysses', with Ulysses
    groups of one the ring's (``parallel/hybrid.py``)."""
    top, m = cfg.topology, cfg.model
    if top.cp_kind != "hybrid":
        return top.cp_kind
    u, r = cp_factors(top, m.n_heads, family_of(m).kv_heads(m))
    return "ulysses" if r == 1 else "ring" if u == 1 else "hybrid"


def block_activation_bytes(cfg: Config) -> int:
    """Bytes autograd saves per block per sequence (measured layout, see tests):
    two norms, q, k, v and the attention output (over tp; grouped-query: k and v after the
    repeat, as many heads as q), the attention log-sum-exp (per head, float32 for 16-bit),
    the MLP's hidden-sized tensors (over tp; the family's ``mlp_saved``: GELU's input and
    output; SwiGLU's gate, silu(gate), up and their product). With cp > 1, per
    ``seq_len / cp`` tokens, and the attention saves (``ATTENTION_SAVED``, per kind) the
    layer's input, q, k and v (ring and hybrid: kv heads; Ulysses: repeated to the query
    heads for its fused attention), its output and the output reshaped for ``wo`` (one
    tensor for the ring, whose output is laid out as ``wo`` reads it). Selective recompute
    (cp = 1): q, k and v (kv heads) and the output for ``wo``, no log-sum-exp."""
    m, tp, cp = cfg.model, cfg.topology.tp, cfg.topology.cp
    T, C, F, ps = local_tokens(cfg), m.d_model, m.ffn_dim, DTYPE_BYTES[m.dtype]
    ls = 4 if ps == 2 else ps
    family = family_of(m)
    hidden = family.mlp_saved
    kv = family.kv_width(m)
    attn, shared = family.attention_saved(m)  # the family's: over tp and on every tp rank
    attn = attn if cp <= 1 else ATTENTION_SAVED[_attention_kind(cfg)](C, kv)
    lse = m.n_heads // tp * ls
    if m.recompute == "selective" and cp <= 1:  # the core keeps its inputs q, k, v (kv
        attn, lse = 2 * C + kv, 0  # heads, before rotary and repeat); wo keeps its input
    return 2 * _norm_bytes(T, C, ps) + T * ((attn // tp + shared) * ps + lse
                                            + hidden * F // tp * ps)


def _ends_activation_bytes(cfg: Config, first: bool, last: bool) -> int:
    """Token ids (first stage); final norm, log-softmax over the vocabulary (float32 for
    16-bit) and targets (last stage). Per sequence."""
    m, T, ps = cfg.model, local_tokens(cfg), DTYPE_BYTES[cfg.model.dtype]
    V = -(-m.vocab_size // cfg.topology.tp)
    out = 8 * T if first else 0
    if last:
        out += _norm_bytes(T, m.d_model, ps) + T * V * (4 if ps == 2 else ps) + 8 * T
        out += m.mtp_depth * (block_activation_bytes(cfg) + T * V * (4 if ps == 2 else ps))
    return out


def in_flight(cfg: Config) -> float:
    """Microbatches whose activations the first stage holds at once: the schedule's
    registry entry says (dualpipev: every rank, in whole-rank microbatches: 2pp+1 of one
    chunk's)."""
    from ..pipeline.schedules import kind_of

    return kind_of(cfg.schedule.kind).in_flight(cfg.topology.pp, microbatches(cfg))


@dataclass
class Estimate:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    comm: dict = field(default_factory=dict)  # axis -> bytes sent per rank per step
    elements: int = 0  # parameter elements of the most loaded rank, unsharded

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def estimate(cfg: Config) -> Estimate:
    """Per-rank bytes of the most loaded pipeline stage (see the module docstring)."""
    from ..parallel.grad_sync.factory import strategy_of
    from ..pipeline.placement import chunks_of_rank, partition
    from ..pipeline.schedules import kind_of, style_of, virtual_stages

    m, top = cfg.model, cfg.topology
    ps = DTYPE_BYTES[m.dtype]
    ss = 8 if m.dtype == "float64" else 4  # shard / state element size
    v = virtual_stages(cfg)
    ranges = partition(m.n_layers, top.pp * v)
    S = len(ranges)
    style = style_of(cfg.schedule.kind)
    kinds = [(len(ranges[s]), s == 0, s == S - 1) for s in range(S)]  # few distinct ones
    params = {k: stage_params(cfg, *k) for k in set(kinds)}
    per_rank = [sum(params[kinds[s]]
                    for s in chunks_of_rank(r, top.pp, v, style)) for r in range(top.pp)]
    P = max(per_rank)
    sync = strategy_of(cfg)  # the gradient sync's parameters, gradients and state sharding
    e = Estimate(elements=P)
    e.params, e.grads = sync.memory(cfg, P, ps, lambda: gathered(cfg))
    states = 2 * ss + (4 if ps == 2 else 0)
    e.optimizer = P * states // sync.state_shards(cfg)
    B, M, held = cfg.train.micro_batch_size, microbatches(cfg), in_flight(cfg)
    blk = block_activation_bytes(cfg)
    worst, ends_of = 0, {k[1:]: _ends_activation_bytes(cfg, *k[1:]) for k in params}
    for r in range(top.pp):  # the rank whose in-flight activations are largest
        mine = chunks_of_rank(r, top.pp, v, style)
        layers = sum(len(ranges[s]) for s in mine)
        if m.recompute == "full":  # block inputs, plus one block live again in its backward
            per_mb = layers * local_tokens(cfg) * m.d_model * ps + blk
        else:
            per_mb = layers * blk
        ends = sum(ends_of[kinds[s][1:]] for s in mine)
        flight = held if r == 0 or kind_of(cfg.schedule.kind).flight_everywhere \
            else max(1, held - r)
        worst = max(worst, int(B * (per_mb + ends) * flight))
    e.activations = worst
    e.comm = comm_volume(cfg, P, ps, M, sync)
    return e


def gathered(cfg: Config) -> tuple[int, int]:
    """ZeRO-3: (elements of the largest unit, elements gathered at once at the peak): a
    block and the next unit (a block, or a root: the embedding, or the final norm and
    head); with a tied head (pp = 1) the root, held from the embedding to the head, and two
    blocks."""
    block = stage_params(cfg, 1, False, False)  # block 0: an MoE block if any
    if cfg.model.tie_embeddings:
        root = stage_params(cfg, 0, True, True)
        return max(block, root), root + 2 * block
    big = max(block, stage_params(cfg, 0, True, False), stage_params(cfg, 0, False, True))
    return big, big + block


def comm_volume(cfg: Config, P: int, ps: int, M: int, sync=None) -> dict:
    """Bytes each rank sends per step per axis (ring algorithms: an all-reduce of N bytes
    sends 2N(d-1)/d, a reduce-scatter or all-gather N(d-1)/d); over dp x cp what the
    gradient-sync strategy sends (``sync``, else the one the config selects:
    ``GradSync.dp_bytes``)."""
    top, m, t = cfg.topology, cfg.model, cfg.train
    out = {}
    d = top.dp * top.cp  # the replicas of a parameter: dp x cp
    if d > 1:
        if sync is None:
            from ..parallel.grad_sync.factory import strategy_of

            sync = strategy_of(cfg)
        out["dp"] = sync.dp_bytes(cfg, P, ps, M)
    act = t.micro_batch_size * local_tokens(cfg) * m.d_model * ps  # one (B, T/cp, C)
    layers_here = -(-m.n_layers // top.pp)
    if top.cp > 1:  # the ring of r ranks: k and v blocks forward (r-1 hops), again
        family = family_of(m)  # backward with their gradients (r hops); Ulysses over u
        heads = family.kv_heads(m)  # ranks: q, k, v and the output, both passes
        kv = t.micro_batch_size * local_tokens(cfg) * family.kv_width(m) * ps // top.tp
        qo = kv // heads * m.n_heads
        u, r = {"ring": (1, top.cp), "ulysses": (top.cp, 1)}.get(top.cp_kind) or \
            cp_factors(top, m.n_heads, heads)
        out["cp"] = int(layers_here * M * ((r > 1) * kv * (3 * r - 2)
                                           + 2 * (qo + kv) * (u - 1) / u))
    if top.tp > 1:  # 2 all-reduces forward + 2 backward per block, per microbatch
        out["tp"] = int(4 * layers_here * M * act * 2 * (top.tp - 1) / top.tp)
    if top.pp > 1:  # one activation forward and one gradient backward per microbatch
        out["pp"] = int(2 * M * act)
    if top.ep > 1 and m.num_experts:
        moe_layers = sum(1 for i in range(layers_here) if m.moe_layer(i))
        out["ep"] = int(4 * moe_layers * M * act * m.top_k * (top.ep - 1) / top.ep)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '512MiB', '1e9' -> bytes (powers of 1024 for K/M/G/T)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"memory size {text!r}: expected e.g. 80GiB, 512MiB or 1e9") from None


def report(cfg: Config, memory_per_rank: int = 0) -> str:
    """The plan's memory section: a table per rank, comm per axis, a fit warning."""
    e = estimate(cfg)
    o = cfg.optim
    lines = [f"memory per rank (most loaded stage; zero={o.zero}, dtype={cfg.model.dtype}, "
             f"recompute={cfg.model.recompute}, "
             f"{in_flight(cfg)} microbatch(es) in flight):"]
    for key in ("params", "grads", "optimizer", "activations", "total"):
        lines.append(f"  {key:<12} {fmt_bytes(getattr(e, key)):>12}")
    lines.append("communication per rank per step: " + (", ".join(
        f"{k} {fmt_bytes(v)}" for k, v in e.comm.items()) or "none"))
    m = cfg.model
    cache = family_of(m).kv_cache_elems(m) * m.n_layers * DTYPE_BYTES[m.dtype]
    lines.append(f"KV cache of generation: {fmt_bytes(cache)} per token")
    if memory_per_rank:
        if e.total > memory_per_rank:
            lines.append(f"WARNING: needs {fmt_bytes(e.total)} per rank but only "
                         f"{fmt_bytes(memory_per_rank)} is available: raise optim.zero, "
                         "set model.recompute=\"full\", or add tp/pp ranks")
        else:
            lines.append(f"fits: {fmt_bytes(e.total)} of {fmt_bytes(memory_per_rank)} "
                         f"({100 * e.total / memory_per_rank:.0f}%)")
    return "\n".join(lines)
