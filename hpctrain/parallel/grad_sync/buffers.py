"""Data parallelism: gradients live in flat buffers and are summed over the data-parallel
group in buckets, never one call per parameter.

Each parameter's ``.grad`` is a view into one flat buffer per reduction group (dense
parameters: ``topo.dpcp_comm``; expert parameters: ``topo.edpcp_comm``: the data-parallel
groups, times the context-parallel ring when cp > 1, whose ranks hold the same parameters
and different tokens), so autograd accumulates
microbatch gradients in place and a bucket is handed to MPI without a copy. Buckets are cut in
reverse parameter order (the order backward produces gradients) at ``bucket_mb``.

16-bit parameters (bfloat16, float16) accumulate and reduce in float32, as Megatron's "main
grads" do: the flat buffer is float32 and each parameter's view into it is ``p.main_grad``;
autograd still produces a 16-bit ``p.grad`` per microbatch (transient), which a
post-accumulate hook adds into ``p.main_grad`` (exact) and frees. The optimizer, the gradient
norm and clipping read :func:`main_grad`. For float32/float64 the main grad IS ``p.grad`` (no
second buffer, no hook, bit-identical to before).

The loss is scaled by 1/(global tokens) before backward, so the *sum* over ranks is exactly the
gradient of the global mean loss (no division after the reduction).

Modes (``optim.zero``, ``optim.overlap``):

- zero 0: each bucket is all-reduced in place.
- zero 1: each bucket (padded to a multiple of the group size) is reduce-scattered into this
  rank's fp32 gradient shard ``bucket.shard`` (float64 for float64 models); the flat buffer
  stays, the reduced full gradient never exists.
- zero 2: no persistent flat buffer. A post-accumulate hook moves each microbatch's gradient
  into a per-bucket staging buffer (float32 for 16-bit models) and frees ``p.grad``; a bucket
  is reduce-scattered into its shard (and its staging freed) as soon as all its parameters
  have this microbatch's gradient. Microbatches are summed in the float32 shard.
- zero 3: as zero 2, with one bucket per block (and per stage root) and reduction group
  instead of buckets cut by size; the parameters themselves are sharded too
  (``parallel/grad_sync/zero3.py``).
- overlap (zero 0/1): the same hooks post a bucket's nonblocking reduction as soon as all its
  gradients of the LAST microbatch are final; :meth:`reduce` waits for all of them. How
  posted reductions progress while autograd computes is ``progress``
  (``optim.overlap_progress``, ``auto`` decided by :func:`progress_for`): ``test`` (libnbc,
  ``MPI_Test`` on every outstanding one from each hook), ``thread``/``poll``
  (``comm.ProgressThread``: a thread runs them on a duplicate communicator, blocking or nonblocking
  + ``MPI_Test``), ``wait`` (libnbc, only the final wait). :func:`overlap_on` also turns
  overlap on where dp crosses nodes.
- without overlap, ``optim.reduction`` picks how zero 0 sums: ``bucketed`` (default: one
  blocking all-reduce per bucket, in order), ``bucketed-nonblocking`` (all buckets posted,
  then waited for) or ``per-parameter`` (the naive baseline the benchmarks compare with).
  ``topology.dp_reduction = hierarchical`` hands each bucket to ``hierarchical.py``.

Posts follow one fixed sequence on every rank, (microbatch, bucket) in order, whatever the
order in which hooks fire, so nonblocking collectives always match across the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import comm

_LOW = (torch.bfloat16, torch.float16)  # accumulated and reduced in float32 main grads
POLL_S = 0.0005  # optim.overlap_progress = "poll": seconds between MPI_Test calls


@dataclass
class Bucket:
    group: comm.Group
    flat: torch.Tensor | None  # contiguous slice of a flat gradient buffer (None: zero 2)
    names: list[str]
    params: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each param in bucket
    numel: int = 0  # padded length, a multiple of the group size when sharded
    dtype: torch.dtype = torch.float32
    shard: torch.Tensor | None = None  # (numel / group.size,) reduced gradient, zero 1/2
    staging: torch.Tensor | None = None  # zero 2: (numel,) this microbatch's gradients
    posted: int = 0  # reductions posted this step
    arrived: int = 0  # gradients its parameters' hooks delivered this step (overlap)
    unit: int = 0  # zero 3: the unit (block or stage root) this bucket belongs to
    pshard: torch.Tensor | None = None  # zero 3: this rank's shard of the parameters
    full: torch.Tensor | None = None  # zero 3: the gathered parameters (storage freed)

    @property
    def shard_range(self) -> tuple[int, int]:
        """[lo, hi) of this rank's shard within the bucket."""
        n = self.numel // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n


def shard_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulated and reduced gradients, master weights and Adam states: float64 stays,
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def progress_for(ocfg, topo) -> str:
    """``optim.overlap_progress`` with ``auto`` decided: the offload thread where the dp
    groups cross nodes (``topo.within_node``, the same on every rank) and MPI provides
    ``MPI_THREAD_MULTIPLE`` (measured fastest over TCP on a quiet machine), else ``test``."""
    if ocfg.overlap_progress != "auto":
        return ocfg.overlap_progress
    crosses = not topo.within_node.get("dp", True)
    return "thread" if crosses and comm.thread_multiple()[0] else "test"


def overlap_on(ocfg, topo, dp_reduction: str, progress: str) -> bool:
    """Whether this run overlaps the dp reduction with backward: ``optim.overlap``, or
    (``optim.overlap_across_nodes``) a flat bucketed reduction whose dp groups cross nodes
    (``topo.within_node``, the same answer on every rank; edp groups lie inside dp's) with a
    progress that wins there: not ``auto``'s fallback ``test``, measured slower than
    blocking buckets over TCP on a quiet machine (``progress``: :func:`progress_for`)."""
    if ocfg.overlap:
        return True
    wins = ocfg.overlap_progress != "auto" or progress != "test"
    return bool(ocfg.overlap_across_nodes and not topo.within_node.get("dp", True) and wins
                and ocfg.reduction == "bucketed" and dp_reduction == "flat")


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer reads: a 16-bit parameter's float32 ``p.main_grad`` (zero
    0/1 :class:`GradBuffers`), else ``p.grad`` itself."""
    if p.dtype in _LOW and hasattr(p, "main_grad"):
        return p.main_grad
    return p.grad


class GradBuffers:
    """Flat gradient storage and the bucketed reduction over the data-parallel groups."""

    def __init__(self, named_params, topo, bucket_mb: float, hierarchical=None, *,
                 zero: int = 0, overlap: bool = False, microbatches: int = 1,
                 mode: str = "bucketed", progress: str = "test",
                 units: list | None = None):
        if zero and hierarchical is not None:
            raise ValueError("optim.zero > 0 needs topology.dp_reduction = flat")
        if mode != "bucketed" and (zero or overlap or hierarchical is not None):
            raise ValueError(f"optim.reduction={mode} needs zero 0, no overlap, flat dp")
        self.topo, self.zero_level, self.microbatches = topo, zero, microbatches
        self.mode = mode  # optim.reduction
        self.overlap = overlap or zero >= 2
        self.progress = progress  # optim.overlap_progress: thread, poll, test or wait
        self.sharded = None  # zero 3: the parallel.zero3.ShardedParams
        self.named = list(named_params)
        self.hierarchical = hierarchical  # optional callable(flat) for multi-node dp
        by_group: dict[str, list] = {"dp": [], "edp": []}
        for name, p in self.named:
            by_group["edp" if p.hp.expert_dim is not None else "dp"].append((name, p))
        groups = {"dp": topo.dpcp_comm, "edp": topo.edpcp_comm}  # = dp/edp when cp = 1
        self.flats: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        limit = max(1, int(bucket_mb * 2**20))
        if zero == 3:  # one bucket per unit and group, in backward order (zero3.units_of)
            names = dict(self.named)
            for k, unit in enumerate(units):
                for key in by_group:
                    items = [(n, names[n]) for n in unit
                             if (names[n].hp.expert_dim is not None) == (key == "edp")]
                    if items:
                        self._build(items, groups[key], 2**62, unit=k)
        else:
            for key, items in by_group.items():
                if items:
                    self._build(items, groups[key], limit)
        self.sp_params = [p for _, p in self.named if p.hp.sp_partial and topo.tp_size > 1]
        self._where = {id(p): (b, off) for b in self.buckets
                       for p, off in zip(b.params, b.offsets)}
        self._count = {id(p): 0 for _, p in self.named}  # gradients accumulated this step
        self._pending: list = []  # (handle, bucket, recv or None)
        self._tested = 0  # _pending[:_tested] are complete (progress: test)
        self._next = 0  # reductions posted this step: the next is (k, bucket) = divmod
        self.posted_early = 0  # reductions posted from hooks, i.e. during backward
        self.offload = self._offload(groups)
        for _, p in self.named:  # 16-bit: into the float32 main grad after every backward
            if self.overlap or p.dtype in _LOW:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _offload(self, groups: dict) -> comm.ProgressThread | None:
        """The thread that runs overlapped reductions (``progress`` thread or poll), over the
        groups with more than one rank. Collective over them (each is duplicated)."""
        if not self.overlap or self.progress not in ("thread", "poll"):
            return None
        used = [g for g in groups.values()
                if any(b.group is g for b in self.buckets) and g.size > 1]
        poll_s = POLL_S if self.progress == "poll" else 0.0
        return comm.ProgressThread(used, poll_s) if used else None

    def close(self) -> None:
        """Stop the offload thread, if any (after the reductions already posted)."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def _build(self, items, group: comm.Group, limit: int, unit: int = 0) -> None:
        dtype = items[0][1].dtype
        if any(p.dtype != dtype for _, p in items):
            raise ValueError("all parameters of one reduction group must share a dtype")
        # Reverse order: the last layers' gradients are final first during backward.
        cut, cur, nbytes = [], [], 0
        for name, p in reversed(items):
            cur.append((name, p))
            nbytes += p.numel() * p.element_size()
            if nbytes >= limit:
                cut, cur, nbytes = cut + [cur], [], 0
        if cur:
            cut.append(cur)
        pad = group.size if self.zero_level else 1
        buckets = []
        for members in cut:
            offsets, n = [], 0
            for _, p in members:
                offsets.append(n)
                n += p.numel()
            buckets.append(Bucket(group, None, [m for m, _ in members], [p for _, p in members],
                                  offsets, -(-n // pad) * pad, dtype, unit=unit))
        if self.zero_level < 2:  # one flat buffer; every main grad a view into it
            flat = torch.zeros(sum(b.numel for b in buckets), dtype=shard_dtype(dtype),
                               device=items[0][1].device)
            self.flats.append(flat)
            start = 0
            for b in buckets:
                b.flat = flat[start:start + b.numel]
                for p, off in zip(b.params, b.offsets):
                    view = b.flat[off:off + p.numel()].view_as(p)
                    if dtype in _LOW:
                        p.main_grad, p.grad = view, None
                    else:
                        p.grad = view
                start += b.numel
        if self.zero_level:
            for b in buckets:
                b.shard = torch.zeros(b.numel // group.size, dtype=shard_dtype(dtype),
                                      device=items[0][1].device)
        self.buckets += buckets

    # -- per step ----------------------------------------------------------------------
    def zero(self) -> None:
        """Clear gradients before a step (flat buffers, shards, hook counters)."""
        for flat in self.flats:
            flat.zero_()
        for b in self.buckets:
            if b.shard is not None:
                b.shard.zero_()
            b.staging, b.posted, b.arrived = None, 0, 0
        self.posted_early, self._next = 0, 0
        for k in self._count:
            self._count[k] = 0
        for _, p in self.named:
            if self.zero_level >= 2 or p.dtype in _LOW:
                p.grad = None

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate hook: move the gradient into the float32 main grad (16-bit, zero
        0/1) or the staging buffer (zero 2) and free ``p.grad``; with overlap, count it and
        post what is ready."""
        if self.zero_level >= 2:
            b, off = self._where[id(p)]
            if b.staging is None:
                b.staging = torch.zeros(b.numel, dtype=shard_dtype(b.dtype), device=p.device)
            b.staging[off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        elif p.dtype in _LOW:
            p.main_grad.add_(p.grad)
            p.grad = None
        if self.overlap:
            self._count[id(p)] += 1
            self._where[id(p)][0].arrived += 1
            self._post_ready()
            if self.progress == "test":
                self._drive()

    def _drive(self) -> None:
        """Drive libnbc from a hook (MPI progresses only inside calls): ``MPI_Test`` on the
        oldest reduction not yet complete; one call progresses every outstanding nonblocking
        collective of the process. Complete ones are passed once, so a hook costs O(1), not
        O(reductions posted this step) (which made ZeRO-2's per-microbatch reductions
        quadratic in the microbatches)."""
        pending = self._pending
        while self._tested < len(pending) and pending[self._tested][0].test():
            self._tested += 1

    def _post_ready(self, flush: bool = False) -> None:
        """Post reductions in the fixed (microbatch, bucket) order while they are ready: a
        bucket is ready at microbatch count k (1 .. M with zero 2 and 3, else M only)."""
        per_mb, n = self.zero_level >= 2, len(self.buckets)
        while self._next < (self.microbatches if per_mb else 1) * n:
            i, j = divmod(self._next, n)
            k, b = (i + 1 if per_mb else self.microbatches), self.buckets[j]
            # every parameter has k gradients: the sum first (one comparison), the minimum
            # only once the sum allows it (O(1) per hook, not O(parameters per bucket))
            if not flush and (b.arrived < k * len(b.params)
                              or min(self._count[id(p)] for p in b.params) < k):
                return
            self.posted_early += not flush
            self._post(b)

    def _post(self, b: Bucket) -> None:
        b.posted += 1
        self._next += 1
        thread = self.offload if b.group.size > 1 else None
        if self.zero_level == 0:
            if b.group.size > 1:
                h = (thread.allreduce_(b.group, b.flat) if thread is not None
                     else b.group.iallreduce_(b.flat))
                self._pending.append((h, b, None))
            return
        send = b.flat
        if self.zero_level >= 2:
            send = b.staging if b.staging is not None else b.shard.new_zeros(b.numel)
            b.staging = None  # freed when the reduction completes
        recv = torch.empty_like(b.shard)
        h = (thread.reduce_scatter(b.group, send, recv) if thread is not None
             else b.group.ireduce_scatter(send, recv))
        self._pending.append((h, b, recv))

    def _wait_all(self) -> None:
        for handle, b, recv in self._pending:
            handle.wait()
            if recv is not None:
                b.shard.add_(recv)
        self._pending, self._tested = [], 0

    def reduce(self) -> None:
        """Finish the step's reduction: post what the hooks have not, wait for everything,
        then sum sequence-parallel partial gradients over tp (sums over dp and tp commute).
        Collective over dp_comm, edp_comm and tp_comm."""
        if self.mode == "per-parameter":
            self.reduce_per_parameter()
            return
        if self.hierarchical is not None:
            for b in self.buckets:
                self.hierarchical(b)
        elif self.overlap or self.mode == "bucketed-nonblocking":
            self._post_ready(flush=True)
        else:
            # Nothing to overlap with: reduce one bucket after another with the blocking
            # collective. Measured with Open MPI (docs/multi-node.md): nonblocking collectives
            # (libnbc) are ~1.9x slower over TCP with all buckets outstanding, and slower on
            # shared memory too; the blocking, tuned all-reduce is the fast path here.
            for b in self.buckets:
                if self.zero_level == 0:
                    b.posted += 1
                    self._next += 1
                    b.group.allreduce_(b.flat)
                else:
                    self._post(b)
                    self._wait_all()
        self._wait_all()
        if self.sharded is not None:  # zero 3: no gathered parameters outlive the step
            self.sharded.free_all()
        if self.zero_level:
            for b in self.buckets:
                for lo, hi in self.sp_ranges(b):
                    self.topo.tp_comm.allreduce_(b.shard[lo:hi])
        else:
            for p in self.sp_params:
                self.topo.tp_comm.allreduce_(main_grad(p))

    # -- shard geometry (ZeRO) -----------------------------------------------------------
    def segments(self, b: Bucket):
        """(param, lo, hi, plo, phi) for each parameter overlapping this rank's shard: shard
        elements [lo, hi) hold flattened parameter elements [plo, phi)."""
        s0, s1 = b.shard_range
        for p, off in zip(b.params, b.offsets):
            a, e = max(off, s0), min(off + p.numel(), s1)
            if a < e:
                yield p, a - s0, e - s0, a - off, e - off

    def sp_ranges(self, b: Bucket):
        if self.topo.tp_size == 1:
            return []
        return [(lo, hi) for p, lo, hi, _, _ in self.segments(b) if p.hp.sp_partial]

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now (flat buffers, staging, shards)."""
        n = sum(f.numel() * f.element_size() for f in self.flats)
        for b in self.buckets:
            for t in (b.shard, b.staging):  # (zero 3 parameters: ShardedParams)
                n += 0 if t is None else t.numel() * t.element_size()
        return n

    def reduce_per_parameter(self) -> None:
        """The naive baseline (``optim.reduction = "per-parameter"``): one blocking all-reduce
        per parameter. Collective over dp_comm, edp_comm and tp_comm."""
        for p in self.sp_params:
            self.topo.tp_comm.allreduce_(main_grad(p))
        for _, p in self.named:
            group = self.topo.edpcp_comm if p.hp.expert_dim is not None \
                else self.topo.dpcp_comm
            group.allreduce_(main_grad(p))
