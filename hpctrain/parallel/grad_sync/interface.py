"""The interface every gradient-sync strategy implements (:class:`GradSync`) and what they
share: the bucket layout (:class:`BucketLayout`, the one cut :func:`cut`), the dtype the
reductions carry (``optim.grad_comm_dtype``: :func:`wire_dtype`), and the planner's terms of
a strategy (memory and communication, class methods from the configuration alone).

**Bucket layout.** Parameters are split by reduction group first (dense parameters:
``topo.dpcp_comm``; expert parameters: ``topo.edpcp_comm``: the data-parallel groups, times
the context-parallel ring when cp > 1, whose ranks hold the same parameters and different
tokens). With HSDP (``topo.hsdp``, sharded strategies only) a bucket's group is the shard
group inside them and ``bucket.replica`` the group that holds copies of its shard. Within a
group, buckets are cut in reverse parameter order (the order backward produces gradients): a
bucket closes once its bytes reach ``bucket_mb``. ZeRO-3 cuts one bucket per unit (block or
stage root) and group instead (``units``).

Storage: with a flat buffer (ZeRO 0 and 1) each parameter's gradient is a view into it, so
autograd accumulates microbatch gradients in place and a bucket is handed to MPI without a
copy. 16-bit parameters (bfloat16, float16) accumulate and reduce in float32: the flat buffer
is float32 and each parameter's view into it is ``p.main_grad`` (:func:`main_grad`); for
float32/float64 the main grad IS ``p.grad``. Sharded strategies pad every bucket to a
multiple of the group size and hold this rank's reduced shard in ``bucket.shard``.

**Wire dtype.** What gradient reductions carry (``optim.grad_comm_dtype``): the gradients'
own dtype (``""``), or bfloat16 (half the bytes of float32). Only the transfer is 16-bit: a
bucket is accumulated in its float32 buffer, converted just before its collective (rounded
to nearest), summed as bfloat16 words (``comm``'s ``sum16``, ``comm/sum16.py``) and
converted back into the float32 buffer or shard the optimizer reads.

**The step.** A strategy is chosen once at set-up (``factory.py``); the step calls
:meth:`GradSync.zero` before the microbatches, :meth:`GradSync.reduce` after them, and
:meth:`GradSync.close` once at the end. The optimizer reads ``buckets``, ``named``,
``zero_level`` and, for sharded strategies, each bucket's ``shard``
(:meth:`GradSync.segments` maps shards to parameters). The loss is scaled by 1/(global
tokens) before backward, so the *sum* over ranks is exactly the gradient of the global mean
loss (no division after the reduction).

**Prices.** The planner (``planner/cost.py``, ``planner/memory.py``) asks the class the
configuration selects (``factory.strategy_of``) for its terms: :meth:`GradSync.memory`,
:meth:`GradSync.state_shards`, :meth:`GradSync.hooks`, :meth:`GradSync.posts`,
:meth:`GradSync.overlapped`, :meth:`GradSync.dp_bytes`, :meth:`GradSync.dp_seconds` and
``shards_parameters``. No tensor, no MPI: numbers from the configuration.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from ... import comm

LOW = (torch.bfloat16, torch.float16)  # accumulated and reduced in float32 main grads


@dataclass
class Bucket:
    group: comm.Group
    flat: torch.Tensor | None  # contiguous slice of a flat gradient buffer (None: zero 2/3)
    names: list[str]
    params: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each param in bucket
    numel: int = 0  # padded length, a multiple of the group size when sharded
    dtype: torch.dtype = torch.float32
    shard: torch.Tensor | None = None  # (numel / group.size,) reduced gradient, zero 1-3
    staging: torch.Tensor | None = None  # zero 2/3: (numel,) this microbatch's gradients
    posted: int = 0  # reductions posted this step
    arrived: int = 0  # gradients its parameters' hooks delivered this step (overlap)
    unit: int = 0  # zero 3: the unit (block or stage root) this bucket belongs to
    pshard: torch.Tensor | None = None  # zero 3: this rank's shard of the parameters
    full: torch.Tensor | None = None  # zero 3: the gathered parameters (storage freed)
    replica: comm.Group | None = None  # HSDP: the shard's copies in the other shard groups

    @property
    def shard_range(self) -> tuple[int, int]:
        """[lo, hi) of this rank's shard within the bucket."""
        n = self.numel // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n


def shard_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulated and reduced gradients, master weights and Adam states: float64 stays,
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer reads: a 16-bit parameter's float32 ``p.main_grad`` (flat
    buffers), else ``p.grad`` itself."""
    if p.dtype in LOW and hasattr(p, "main_grad"):
        return p.main_grad
    return p.grad


def group_key(p: torch.Tensor) -> str:
    """The reduction group of a parameter: ``edp`` for an expert's, ``dp`` for a dense one's."""
    return "edp" if p.hp.expert_dim is not None else "dp"


def cut(sizes: list, limit: float) -> list[list[int]]:
    """The buckets of tensors of ``sizes`` bytes (in the model's order): lists of indices into
    ``sizes``, walked in reverse; a bucket closes once its bytes reach ``limit``."""
    out, cur, nbytes = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        nbytes += sizes[i]
        if nbytes >= limit:
            out, cur, nbytes = out + [cur], [], 0
    if cur:
        out.append(cur)
    return out


class BucketLayout:
    """The buckets of ``named`` parameters (see the module docstring). ``sharded``: pad each
    bucket to a multiple of its group's size (ZeRO); ``units``: ZeRO-3's parameter names per
    unit, one bucket per unit and group; ``wire``: the dtype the strategies' reductions carry
    (``optim.grad_comm_dtype``, None: the buffers' own). Allocates nothing until a strategy
    asks."""

    def __init__(self, named, topo, bucket_mb: float, *, sharded: bool = False,
                 units: list | None = None, wire: torch.dtype | None = None):
        self.named, self.topo, self.sharded = list(named), topo, sharded
        self.wire = wire  # the dtype reductions carry (wire_dtype); None: the buffers' own
        by_group: dict[str, list] = {"dp": [], "edp": []}
        for name, p in self.named:
            by_group[group_key(p)].append((name, p))
        self.groups = {"dp": topo.dpcp_comm, "edp": topo.edpcp_comm}  # = dp/edp when cp = 1
        hsdp = getattr(topo, "hsdp", None) if sharded else None
        if hsdp:  # shards within each shard group, copies across (topology.shard_groups)
            self.groups = {key: shard for key, (shard, _) in hsdp.items()}
        replicas = {key: hsdp[key][1] if hsdp else None for key in self.groups}
        self.buckets: list[Bucket] = []
        self.runs: list[list[Bucket]] = []  # the buckets of each _add call (one flat each)
        if units is not None:  # one bucket per unit and group, in backward order
            names = dict(self.named)
            for k, unit in enumerate(units):
                for key in by_group:
                    items = [(n, names[n]) for n in unit if group_key(names[n]) == key]
                    if items:
                        self._add(items, self.groups[key], 2**62, replicas[key], unit=k)
        else:
            limit = max(1, int(bucket_mb * 2**20))
            for key, items in by_group.items():
                if items:
                    self._add(items, self.groups[key], limit, replicas[key])
        self.where = {id(p): (b, off) for b in self.buckets
                      for p, off in zip(b.params, b.offsets)}
        self.sp_params = [p for _, p in self.named if p.hp.sp_partial and topo.tp_size > 1]

    def _add(self, items, group: comm.Group, limit: int, replica=None, unit: int = 0) -> None:
        dtype = items[0][1].dtype
        if any(p.dtype != dtype for _, p in items):
            raise ValueError("all parameters of one reduction group must share a dtype")
        pad = group.size if self.sharded else 1
        run = []
        for idx in cut([p.numel() * p.element_size() for _, p in items], limit):
            members = [items[i] for i in idx]
            offsets, n = [], 0
            for _, p in members:
                offsets.append(n)
                n += p.numel()
            run.append(Bucket(group, None, [m for m, _ in members], [p for _, p in members],
                              offsets, -(-n // pad) * pad, dtype, unit=unit,
                              replica=replica))
        self.runs.append(run)
        self.buckets += run

    def allocate_flats(self) -> list[torch.Tensor]:
        """One flat buffer per run of buckets; every parameter's main grad becomes a view
        into it."""
        flats = []
        for run in self.runs:
            p0 = run[0].params[0]
            flat = torch.zeros(sum(b.numel for b in run), dtype=shard_dtype(run[0].dtype),
                               device=p0.device)
            flats.append(flat)
            start = 0
            for b in run:
                b.flat = flat[start:start + b.numel]
                for p, off in zip(b.params, b.offsets):
                    view = b.flat[off:off + p.numel()].view_as(p)
                    if b.dtype in LOW:
                        p.main_grad, p.grad = view, None
                    else:
                        p.grad = view
                start += b.numel
        return flats

    def allocate_shards(self) -> None:
        """This rank's reduced-gradient shard of every bucket."""
        for b in self.buckets:
            b.shard = torch.zeros(b.numel // b.group.size, dtype=shard_dtype(b.dtype),
                                  device=b.params[0].device)

    def segments(self, b: Bucket):
        """(param, lo, hi, plo, phi) for each parameter overlapping this rank's shard: shard
        elements [lo, hi) hold flattened parameter elements [plo, phi)."""
        s0, s1 = b.shard_range
        for p, off in zip(b.params, b.offsets):
            a, e = max(off, s0), min(off + p.numel(), s1)
            if a < e:
                yield p, a - s0, e - s0, a - off, e - off

    def sp_ranges(self, b: Bucket) -> list[tuple[int, int]]:
        """Shard ranges of sequence-parallel partial gradients (summed over tp after dp)."""
        if self.topo.tp_size == 1:
            return []
        return [(lo, hi) for p, lo, hi, _, _ in self.segments(b) if p.hp.sp_partial]


# -- the wire dtype ----------------------------------------------------------------------
DTYPES = {"": None, "bfloat16": torch.bfloat16}


def wire_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``optim.grad_comm_dtype`` (None: the gradients' own)."""
    return DTYPES[name]


def op_for(t: torch.Tensor, wire: torch.dtype | None) -> tuple:
    """The op argument of a collective about to send ``t``: ``("sum16",)`` for a wire copy,
    none (the collective's own sum) otherwise."""
    return ("sum16",) if wire is not None and t.dtype == wire else ()


def outgoing(t: torch.Tensor, group, wire: torch.dtype | None) -> torch.Tensor:
    """What to hand the collective over ``group``: ``t`` itself, or its wire copy (only
    where there is someone to send it to)."""
    return t if wire is None or group.size == 1 else t.to(wire)


def carried(group, flat: torch.Tensor, wire: torch.dtype | None, reduce) -> None:
    """``reduce(tensor[, op])`` summing ``flat`` in place over ``group``, on its wire copy
    (op ``sum16``) when ``wire`` is set, then copied back into ``flat``."""
    sent = outgoing(flat, group, wire)
    reduce(sent, *op_for(sent, wire))
    if sent is not flat:
        flat.copy_(sent)


def wire_bytes(cfg) -> int:
    """Bytes per gradient element the dp reductions carry: 8 for float64 models, 2 with
    ``optim.grad_comm_dtype = "bfloat16"``, else 4 (the float32 buffers)."""
    return 8 if cfg.model.dtype == "float64" else 2 if cfg.optim.grad_comm_dtype else 4


def state_bytes(cfg) -> int:
    """Bytes per element of gradient buffers, shards and optimizer state
    (:func:`shard_dtype`): 8 for float64 models, else 4."""
    return 8 if cfg.model.dtype == "float64" else 4


class GradSync(abc.ABC):
    """Gradients of one rank's parameters, summed over the data-parallel groups.

    Attributes every strategy has: ``name`` (the factory's table), ``zero_level`` (0: full
    gradients, 1-3: this rank's reduced shard per bucket), ``overlap`` (reductions posted from
    gradient hooks during backward), ``progress`` (how posted reductions advance), ``named``,
    ``buckets``, ``flats`` (flat gradient buffers, empty without), ``sharded`` (ZeRO-3's
    parameter shards, else None), ``posted_early`` (reductions posted during backward this
    step)."""

    name = ""
    zero_level = 0
    overlap = False
    progress = "none"
    algorithm = None  # the all-reduce algorithm the planner prices (None: the cluster's)
    shards_parameters = False  # ZeRO-3: parameters gathered per unit in every pass

    def __init__(self, layout: BucketLayout):
        self.layout, self.topo = layout, layout.topo
        self.named, self.buckets = layout.named, layout.buckets
        self.flats = layout.allocate_flats() if self.zero_level < 2 else []
        if self.zero_level:
            layout.allocate_shards()
        self.sharded = None
        self.posted_early = 0
        for _, p in self.named:
            if self._hooked(p):
                p.register_post_accumulate_grad_hook(self._on_grad)

    @classmethod
    def units(cls, chunks) -> list | None:
        """The layout's units (:class:`BucketLayout`): None, buckets cut by size."""
        return None

    @classmethod
    def from_choices(cls, layout: BucketLayout, **choices) -> GradSync:
        """This strategy over ``layout``; ``choices`` are the factory's (``overlap``,
        ``microbatches``, ``progress``, ``split``, ``chunks``): each takes what it uses."""
        return cls(layout)

    # -- gradient hooks ----------------------------------------------------------------
    def _hooked(self, p: torch.Tensor) -> bool:
        """Whether ``p`` gets the post-accumulate hook: 16-bit parameters always (into the
        float32 main grad after every backward)."""
        return p.dtype in LOW

    def _on_grad(self, p: torch.Tensor) -> None:
        self._accumulate(p)

    def _accumulate(self, p: torch.Tensor) -> None:
        """Move a 16-bit microbatch gradient into the float32 main grad and free it."""
        if p.dtype in LOW:
            p.main_grad.add_(p.grad)
            p.grad = None

    # -- per step ----------------------------------------------------------------------
    def zero(self) -> None:
        """Clear gradients before a step (flat buffers, shards, hook counters)."""
        for flat in self.flats:
            flat.zero_()
        for b in self.buckets:
            if b.shard is not None:
                b.shard.zero_()
            b.staging, b.posted, b.arrived = None, 0, 0
        self.posted_early = 0
        for _, p in self.named:
            if self.zero_level >= 2 or p.dtype in LOW:
                p.grad = None

    def reduce(self) -> None:
        """Finish the step's reduction: sum every bucket over its group (:meth:`_sum`, the
        strategy) and, with HSDP, the shards across shard groups (:meth:`_across`), then sum
        sequence-parallel partial gradients over tp (sums over dp and tp commute). Collective
        over dp_comm, edp_comm and tp_comm."""
        self._sum()
        self._across()
        self._finish()

    @abc.abstractmethod
    def _sum(self) -> None:
        """Sum every bucket over its group (all-reduce in place, or reduce-scatter into the
        shards), in bucket order; nothing left in flight on return."""

    def _across(self) -> None:
        """HSDP: sum each reduced shard over its copies in the other shard groups (every copy
        then holds the gradient summed over the whole replica group). Collective over each
        bucket's ``replica`` group, in the wire dtype (:func:`wire_dtype`) like the reduction
        before."""
        posted = []
        for b in self.buckets:
            if b.replica is not None and b.replica.size > 1:
                wire = self.layout.wire
                sent = outgoing(b.shard, b.replica, wire)
                posted.append((b, sent, b.replica.iallreduce_(sent, *op_for(sent, wire))))
        for b, sent, h in posted:
            h.wait()
            if sent is not b.shard:
                b.shard.copy_(sent)

    def _finish(self) -> None:
        if self.sharded is not None:  # zero 3: no gathered parameters outlive the step
            self.sharded.free_all()
        if self.zero_level:
            for b in self.buckets:
                for lo, hi in self.sp_ranges(b):
                    self.topo.tp_comm.allreduce_(b.shard[lo:hi])
        else:
            for p in self.layout.sp_params:
                self.topo.tp_comm.allreduce_(main_grad(p))

    def close(self) -> None:  # noqa: B027 (most strategies hold nothing beyond a step)
        """Release what the strategy holds beyond the step (a progress thread)."""

    # -- geometry and memory -------------------------------------------------------------
    def segments(self, b: Bucket):
        """See :meth:`BucketLayout.segments`."""
        return self.layout.segments(b)

    def sp_ranges(self, b: Bucket) -> list[tuple[int, int]]:
        return self.layout.sp_ranges(b)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now (flat buffers, staging, shards)."""
        n = sum(f.numel() * f.element_size() for f in self.flats)
        for b in self.buckets:
            for t in (b.shard, b.staging):  # (zero 3 parameters: ShardedParams)
                n += 0 if t is None else t.numel() * t.element_size()
        return n

    # -- prices: the planner's terms, from the configuration alone ---------------------
    @classmethod
    def memory(cls, cfg, P: int, ps: int, gathered) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) one rank holds for ``P`` parameter elements of
        ``ps`` bytes (``gathered()``: ZeRO-3's (largest unit, gathered at once) elements):
        the parameters, and a flat float32 (float64) buffer of all gradients."""
        return P * ps, P * state_bytes(cfg)

    @classmethod
    def state_shards(cls, cfg) -> int:
        """What the optimizer state is divided by: 1, each rank updates all of it."""
        return 1

    @classmethod
    def hooks(cls, cfg) -> bool:
        """Whether a gradient hook runs per parameter tensor and microbatch: for 16-bit
        models (into the float32 main grads)."""
        return cfg.model.dtype in ("bfloat16", "float16")

    @classmethod
    def posts(cls, cfg, nb: int, M: int) -> int:
        """Reductions posted from gradient hooks per step (``nb`` buckets, ``M``
        microbatches): none."""
        return 0

    @classmethod
    def overlapped(cls, cfg) -> bool:
        """Whether the step's dp traffic hides behind the last backward
        (``optim.overlap``)."""
        return cfg.optim.overlap

    @classmethod
    def spins(cls, cfg, progress: str) -> bool:
        """Whether a thread of the rank waits inside MPI, on the rank's core, while backward
        computes (``progress``: ``optim.overlap_progress`` as the factory decides it): no
        thread here."""
        return False

    @classmethod
    def dp_bytes(cls, cfg, P: int, ps: int, M: int) -> int:
        """Bytes a rank sends per step over dp x cp (ring algorithms, ``M`` microbatches):
        one all-reduce of the gradients, ``2 P ps (d-1)/d``."""
        d = cfg.topology.dp * cfg.topology.cp
        frac = (d - 1) / d
        return int(2 * P * ps * frac)

    @classmethod
    def dp_seconds(cls, net, P: int, nb: int) -> float:
        """Seconds of the step's reduction of ``P`` elements in ``nb`` buckets, priced by
        ``net`` (``planner.cost.DpNet``: the groups, links and alpha-beta formulas): one
        all-reduce (``algorithm``) over dp x cp, a collective's latencies per bucket."""
        extra = (nb - 1) * (net.d - 1) * net.link.latency
        return net.allreduce(P * net.gs, cls.algorithm) + 2 * extra
