"""Memory per rank: the plan's estimate (no MPI, no allocation) and the measurement.

**Estimate** (:func:`estimate`): from the config alone, for the most loaded pipeline stage,

- parameters: this rank's elements (blocks of its stage, embedding/head on the first/last
  stage, split over tp; expert weights split over ep) x dtype size;
- gradients, all float32 (float64 for float64; 16-bit models accumulate in float32 "main
  grads", their transient 16-bit ``p.grad`` is not counted): zero 0/1 a flat buffer; zero 1
  also a reduced shard of 1/dp; zero 2 only the shard plus one staging bucket; zero 3 the
  shard plus one block's staging;
- optimizer state: Adam's two moments (+ a float32 master copy for 16-bit parameters), all
  divided by dp under ZeRO;
- HSDP (``topology.shard_within``): "dp" above is the shard group's size, not dp x cp;
- zero 3: parameters divided by dp too, plus what is gathered at once (:func:`gathered`: the
  running unit and the prefetched one: two blocks, or a block and the embedding or head);
- activations: what autograd saves per microbatch, times the microbatches in flight on the
  first stage (pp=1: 1; 1f1b/zb-h1/zbv/interleaved: min(pp, microbatches); gpipe: all).
  Full recompute keeps each block's input plus one block's activations during its backward;
  selective recompute keeps the attention core's inputs (q, k, v with kv heads), not its
  log-sum-exp nor the rotated and repeated keys (:func:`block_activation_bytes`).
  Context parallelism: every rank holds ``seq_len / cp`` tokens of each sequence, so all of
  these are per ``seq_len / cp`` tokens (:func:`local_tokens`).

**Measured peak** (:class:`Meter`): bytes of the parameters + gradient storage (flat
buffers, shards, staging) + optimizer state + the maximum over the step of the bytes held
by autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, counted once per
storage, parameters excluded). Temporaries that autograd does not save (an op's output
before the next op consumes it, gradient tensors during backward) and the recomputation
transient are not counted: on CPU there is no allocator statistic to read them from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..config import Config, microbatches, shard_size
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
        n_moe = sum(1 for i in range(layers) if i % m.moe_every == 0)
        total = layers * per_block + n_moe * expert + (layers - n_moe) * dense_mlp
    else:
        total = layers * (per_block + dense_mlp)
    if first:
        total += vocab_local * C
    if last:
        total += C + (0 if m.tie_embeddings else vocab_local * C)
    return total


def _norm_bytes(T: int, C: int, ps: int) -> int:
    """RMSNorm + its output, per sequence: input, 1/rms, normalised, scaled. 16-bit inputs
    are normalised in float32 (a float32 copy and float32 1/rms)."""
    return T * (4 * C + 4 + 2 * C * ps) if ps == 2 else T * (3 * C * ps + ps)


def local_tokens(cfg: Config) -> int:
    """Tokens of each sequence on one rank: ``seq_len / cp`` (context parallelism)."""
    return cfg.train.seq_len // max(1, cfg.topology.cp)


def block_activation_bytes(cfg: Config) -> int:
    """Bytes autograd saves per block per sequence (measured layout, see tests):
    two norms, q, k, v and the attention output (over tp; grouped-query: k and v after the
    repeat, as many heads as q), the attention log-sum-exp (per head, float32 for 16-bit),
    the MLP's hidden-sized tensors (over tp; the family's ``mlp_saved``: GELU's input and
    output; SwiGLU's gate, silu(gate), up and their product). With cp > 1, per
    ``seq_len / cp`` tokens, and ring attention saves q, k and v (kv heads), its output and
    the output reshaped for ``wo``. Selective recompute (cp = 1): q, k and v (kv heads) and
    the output for ``wo``, no log-sum-exp."""
    m, tp, cp = cfg.model, cfg.topology.tp, cfg.topology.cp
    T, C, F, ps = local_tokens(cfg), m.d_model, m.ffn_dim, DTYPE_BYTES[m.dtype]
    ls = 4 if ps == 2 else ps
    family = family_of(m)
    hidden = family.mlp_saved
    kv = 2 * family.kv_heads(m) * m.head_dim
    attn = 4 * C if cp <= 1 else 3 * C + kv
    lse = m.n_heads // tp * ls
    if m.recompute == "selective" and cp <= 1:  # the core keeps its inputs q, k, v (kv
        attn, lse = 2 * C + kv, 0  # heads, before rotary and repeat); wo keeps its input
    return 2 * _norm_bytes(T, C, ps) + T * (attn // tp * ps + lse + hidden * F // tp * ps)


def _ends_activation_bytes(cfg: Config, first: bool, last: bool) -> int:
    """Token ids (first stage); final norm, log-softmax over the vocabulary (float32 for
    16-bit) and targets (last stage). Per sequence."""
    m, T, ps = cfg.model, local_tokens(cfg), DTYPE_BYTES[cfg.model.dtype]
    V = -(-m.vocab_size // cfg.topology.tp)
    out = 8 * T if first else 0
    if last:
        out += _norm_bytes(T, m.d_model, ps) + T * V * (4 if ps == 2 else ps) + 8 * T
    return out


def in_flight(cfg: Config) -> int:
    """Microbatches whose activations the first stage holds at once."""
    pp, M = cfg.topology.pp, microbatches(cfg)
    if pp == 1:
        return 1
    return M if cfg.schedule.kind == "gpipe" else min(pp, M)


@dataclass
class Estimate:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    comm: dict = field(default_factory=dict)  # axis -> bytes sent per rank per step

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def estimate(cfg: Config) -> Estimate:
    """Per-rank bytes of the most loaded pipeline stage (see the module docstring)."""
    from ..parallel.pipeline import chunks_of_rank, partition, style_of, virtual_stages

    m, top, o = cfg.model, cfg.topology, cfg.optim
    ps = DTYPE_BYTES[m.dtype]
    ss = 8 if m.dtype == "float64" else 4  # shard / state element size
    v = virtual_stages(cfg)
    ranges = partition(m.n_layers, top.pp * v)
    S = len(ranges)
    style = style_of(cfg.schedule.kind)
    per_rank = [sum(stage_params(cfg, len(ranges[s]), s == 0, s == S - 1)
                    for s in chunks_of_rank(r, top.pp, v, style)) for r in range(top.pp)]
    P = max(per_rank)
    d = shard_size(top)  # ZeRO shards over the replicas of a parameter, dp x cp (HSDP: fewer)
    e = Estimate(params=P * ps)
    if o.zero == 3:
        block, at_once = gathered(cfg)
        e.params = P * ps // d + at_once * ps
        e.grads = P * ss // d + block * ss
    elif o.zero == 0:  # gradients accumulate in float32 (float64): ss, not ps
        e.grads = P * ss
    elif o.zero == 1:
        e.grads = P * ss + P * ss // d
    else:  # buckets are cut at bucket_mb of parameter bytes; staging holds them as ss
        e.grads = P * ss // d + min(P * ps, int(o.bucket_mb * 2**20)) * ss // ps
    states = 2 * ss + (4 if ps == 2 else 0)
    e.optimizer = P * states // (d if o.zero else 1)
    B, M = cfg.train.micro_batch_size, microbatches(cfg)
    blk = block_activation_bytes(cfg)
    worst = 0
    for r in range(top.pp):  # the rank whose in-flight activations are largest
        mine = [s for s in range(r, S, top.pp)]
        layers = sum(len(ranges[s]) for s in mine)
        if m.recompute == "full":  # block inputs, plus one block live again in its backward
            per_mb = layers * local_tokens(cfg) * m.d_model * ps + blk
        else:
            per_mb = layers * blk
        ends = sum(_ends_activation_bytes(cfg, s == 0, s == S - 1) for s in mine)
        flight = in_flight(cfg) if r == 0 else max(1, in_flight(cfg) - r)
        worst = max(worst, B * (per_mb + ends) * flight)
    e.activations = worst
    e.comm = comm_volume(cfg, P, ps, M)
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


def comm_volume(cfg: Config, P: int, ps: int, M: int) -> dict:
    """Bytes each rank sends per step per axis (ring algorithms: an all-reduce of N bytes
    sends 2N(d-1)/d, a reduce-scatter or all-gather N(d-1)/d)."""
    top, m, t = cfg.topology, cfg.model, cfg.train
    out = {}
    d = top.dp * top.cp  # the replicas of a parameter: dp x cp
    if d > 1:
        s = shard_size(top)  # the ZeRO collectives' group; HSDP: shards all-reduced across
        frac = (s - 1) / s if cfg.optim.zero else (d - 1) / d
        rs = M if cfg.optim.zero >= 2 else 1  # zero 2/3 reduce every microbatch
        # zero 3: forward and backward gather the stage per microbatch (a split backward's W
        # reads no weight: model/weight_grad.py; the embedding, gathered for the forward
        # only, is counted twice: an upper bound)
        gathers = 2 * M if cfg.optim.zero == 3 else 1
        out["dp"] = int(2 * P * ps * frac) if cfg.optim.zero == 0 else int(
            (rs + gathers) * P * ps * frac + 2 * P * ps / s * (d - s) / d)
    act = t.micro_batch_size * local_tokens(cfg) * m.d_model * ps  # one (B, T/cp, C)
    layers_here = -(-m.n_layers // top.pp)
    if top.cp > 1:  # the ring: k and v blocks forward (cp-1 hops), again backward with
        kv = 2 * t.micro_batch_size * local_tokens(cfg) * family_of(m).kv_heads(m) \
            * m.head_dim * ps // top.tp  # their gradients (cp hops), per layer and microbatch
        out["cp"] = int(layers_here * M * kv * (2 * (top.cp - 1) + top.cp))
        if top.cp_kind == "ulysses":  # q, k, v and the output, forward and backward
            qo = kv // family_of(m).kv_heads(m) * m.n_heads
            out["cp"] = int(layers_here * M * 2 * (qo + kv) * (top.cp - 1) / top.cp)
    if top.tp > 1:  # 2 all-reduces forward + 2 backward per block, per microbatch
        out["tp"] = int(4 * layers_here * M * act * 2 * (top.tp - 1) / top.tp)
    if top.pp > 1:  # one activation forward and one gradient backward per microbatch
        out["pp"] = int(2 * M * act)
    if top.ep > 1 and m.num_experts:
        moe_layers = -(-layers_here // m.moe_every)
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
    if memory_per_rank:
        if e.total > memory_per_rank:
            lines.append(f"WARNING: needs {fmt_bytes(e.total)} per rank but only "
                         f"{fmt_bytes(memory_per_rank)} is available: raise optim.zero, "
                         "set model.recompute=\"full\", or add tp/pp ranks")
        else:
            lines.append(f"fits: {fmt_bytes(e.total)} of {fmt_bytes(memory_per_rank)} "
                         f"({100 * e.total / memory_per_rank:.0f}%)")
    return "\n".join(lines)


# -- measurement -----------------------------------------------------------------------
class _Saved:
    """A saved tensor wrapped so that its release is seen."""

    __slots__ = ("t", "meter", "key")

    def __init__(self, t, meter, key):
        self.t, self.meter, self.key = t, meter, key

    def __del__(self):
        self.meter._release(self.key)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for _, p in params)


class ActivationMeter:
    """Bytes held by autograd's saved tensors: live now and the peak, each storage counted
    once, the given parameters' storages excluded. Not collective; no MPI."""

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.gathered: set = set()  # zero 3: storages of gathered parameters, now
        self._live: dict[int, list] = {}  # storage ptr -> [refs, bytes]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._exclude or key == 0 or key in self.gathered:
            return t
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Saved) else h

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    @contextlib.contextmanager
    def activations(self):
        """Count saved tensors made inside the block (wrap forward and backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def take_peak(self) -> int:
        """The peak since the last call; resets it to the live bytes."""
        out, self.peak = self.peak, self.current
        return out


class Meter(ActivationMeter):
    """Measured memory of one rank (see the module docstring). Not collective.

    The saved-tensor hooks run at the first step metered and every ``every``-th step
    (``telemetry.activations_every``): ``mem_activations`` is the latest such step's peak,
    ``mem_activations_step`` that step."""

    def __init__(self, named_params, grads, optimizer, every: int = 1):
        self.params, self.grads, self.optimizer = list(named_params), grads, optimizer
        super().__init__([p for _, p in self.params])
        if getattr(grads, "sharded", None) is not None:
            self.gathered = grads.sharded.storages  # updated by every gather and free
        self.every = every
        self.metered: int | None = None  # the step (1-based) counted now, if any
        self.last: tuple[int, int] = (0, 0)  # (step, activation peak) of the latest count

    def step(self, step: int):
        """Wrap step ``step``'s (1-based) forward and backward: counted when it is the first
        step here or a multiple of ``every``, else nothing runs."""
        first = self.last[0] == 0
        self.metered = step if first or step % self.every == 0 else None
        return self.activations() if self.metered else contextlib.nullcontext()

    def take(self) -> dict:
        """This step's measured bytes (metrics keys ``mem_*``); resets the activation peak."""
        sharded = getattr(self.grads, "sharded", None)  # zero 3: shards + gathered peak
        gathered = sharded.take_peak() if sharded else 0
        out = {"mem_params": sharded.shard_bytes() + gathered if sharded
               else _nbytes(self.params),
               "mem_grads": self.grads.grad_bytes(),
               "mem_optimizer": self.optimizer.state_bytes(),
               "mem_activations": self._activations()}
        out["mem_peak"] = sum(out.values())
        out["mem_activations_step"] = self.last[0]
        # Evidence of overlap: bucket reductions posted while backward was still running.
        out["grad_buckets_posted_in_backward"] = getattr(self.grads, "posted_early", 0)
        if sharded:  # the part of mem_params that is all-gathered blocks, at its peak
            out["mem_params_gathered"] = gathered
        return out

    def _activations(self) -> int:
        if self.metered:
            self.last, self.metered = (self.metered, self.take_peak()), None
        return self.last[1]
