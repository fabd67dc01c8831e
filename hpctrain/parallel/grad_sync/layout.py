"""The bucket layout every gradient-sync strategy shares: which parameters go into which
bucket, over which group, at which offset (:class:`BucketLayout`), and the one cut of tensors
into buckets (:func:`cut`; the planner counts buckets with it too).

Parameters are split by reduction group first (dense parameters: ``topo.dpcp_comm``; expert
parameters: ``topo.edpcp_comm``: the data-parallel groups, times the context-parallel ring
when cp > 1, whose ranks hold the same parameters and different tokens). With HSDP
(``topo.hsdp``, sharded strategies only) a bucket's group is the shard group inside them and
``bucket.replica`` the group that holds copies of its shard. Within a group,
buckets are cut in reverse parameter order (the order backward produces gradients): a bucket
closes once its bytes reach ``bucket_mb``. ZeRO-3 cuts one bucket per unit (block or stage
root) and group instead (``units``).

Storage: with a flat buffer (ZeRO 0 and 1) each parameter's gradient is a view into it, so
autograd accumulates microbatch gradients in place and a bucket is handed to MPI without a
copy. 16-bit parameters (bfloat16, float16) accumulate and reduce in float32: the flat buffer
is float32 and each parameter's view into it is ``p.main_grad`` (:func:`main_grad`); for
float32/float64 the main grad IS ``p.grad``. Sharded strategies pad every bucket to a
multiple of the group size and hold this rank's reduced shard in ``bucket.shard``.
"""

from __future__ import annotations

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
        self.wire = wire  # the dtype reductions carry (wire.py); None: the buffers' own
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
