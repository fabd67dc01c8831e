"""The ZeRO strategies, levels 1 to 3.

ZeRO-1 and ZeRO-2: every bucket (padded to a multiple of the group size) is reduce-scattered
into this rank's gradient shard ``bucket.shard`` (float32, float64 for
float64 models); the reduced full gradient never exists. ``optim/zero.py`` updates the shards.

- :class:`Zero1` (``optim.zero = 1``): the flat buffer stays; each bucket is reduce-scattered
  after backward, one at a time, or posted from the gradient hooks with overlap (as
  ``buckets.OverlappedBuckets``).
- :class:`Zero2` (``optim.zero = 2``): no persistent flat buffer. A post-accumulate hook moves
  each microbatch's gradient into a per-bucket staging buffer (float32 for 16-bit models) and
  frees ``p.grad``; a bucket is reduce-scattered into its shard (and its staging freed) as
  soon as all its parameters have this microbatch's gradient. Microbatches are summed in the
  shard.

**ZeRO-3**: parameters sharded like their gradients and optimizer state, gathered per block.

With ``optim.zero = 3`` the strategy :class:`Zero3` cuts one bucket per
*unit* and reduction group (:func:`units_of`: every block of a stage, and the stage's two
roots (:func:`roots`): the embedding, and the "head unit", the final norm and head (with the
embedding when the head is tied to it); a block's expert weights form a second
bucket over ``edp_comm``). :class:`ShardedParams` then keeps, per bucket, only this rank's
contiguous shard of the flattened parameters (``bucket.pshard``, the model dtype; padded
like the gradient shard) and a full buffer ``bucket.full`` whose storage exists only while
the unit is gathered. Every parameter is a view into its bucket's full buffer (``p.data``),
so the model code is unchanged: autograd saves the views, and the storage under them is
freed after use and all-gathered again before the backward.

Events (module hooks, no model change; the forward of a stage is always a module call),
per microbatch:

- forward: the stage's pre-hook gathers the embedding (tied: the head unit) and prefetches
  the first block (``iallgather``); a block's pre-hook frees the embedding (first block),
  gathers the block (waits for its prefetch) and prefetches the next unit (after the last
  block: the head unit); its post-hook frees it (the last block's then gathers the head
  unit); the stage's post-hook frees the roots. Every unit: one all-gather.
- backward: the loss (a stage with a head) and each block's output get a tensor hook, which
  fires when that gradient is complete, i.e. just before the unit's backward: gather the
  unit (the loss: the head unit), free the unit the gradient has just left (its backward is
  done: the head unit, or the next block) and prefetch the block whose backward comes next.
  Another stage's output is its last block's output: only the block's hook acts on it. The
  embedding's backward is a scatter-add of the gradient and reads no weight: it is not
  gathered. Every unit but the embedding: one all-gather.
- every parameter's post-accumulate-grad hook: once all parameters of a unit have their
  gradient of this backward, the unit is freed. :class:`Zero3` (ZeRO-2's hooks,
  :class:`Zero2`) has already moved the gradient into the unit's staging bucket and
  reduce-scatters it as soon as the whole unit is done. The runner wraps each backward in
  :meth:`ShardedParams.backward_pass`, which frees what is left (a unit whose parameter got
  no gradient, e.g. an expert without tokens).

So a gather never writes into a buffer in flight or in use: each unit is freed at a fixed
point of the program between two gathers into it, whatever its gradients did. Every gather
is issued on every rank of the group at the same point of the same program (forward calls
and gradient-ready hooks of the same graph), on a duplicate of the group's communicator, so
its order never mixes with the gradient reduce-scatters' on the group.

Pipeline parallelism gathers per microbatch: each forward and each backward action gathers
the blocks it runs and frees them after (two all-gathers of the stage per microbatch, the
memory of two units at a time); see docs/parallelism.md for the choice.

Zero-bubble schedules split a stage's backward into ``B`` (everything but the weight
matmuls) and ``W`` (those matmuls' weight gradients, later; ``pipeline.runner.input_grad``). B
delivers no gradient to the matmul weights, so the "all gradients arrived" rule above never
frees a unit during B: the output hooks' "free the unit the gradient has just left" does
(:meth:`ShardedParams.input_pass`); nothing of the chunk stays gathered after B. W computes
``grad_out^T @ input`` from what B kept and reads no weight: it gathers nothing (two gathers
of the stage per microbatch, as 1F1B); its gradients reach the staging buckets through the
same post-accumulate hooks.
"""

from __future__ import annotations

import contextlib

import torch

from ...config import shard_size
from .buckets import PostedSync
from .interface import Bucket, op_for, outgoing, shard_dtype, state_bytes


class Zero1(PostedSync):
    """Reduce-scatter of the flat buffer's buckets into the shards."""

    name = "zero1"
    zero_level = 1

    @classmethod
    def from_choices(cls, layout, *, overlap: bool = False, microbatches: int = 1,
                     progress: str = "test", **_) -> Zero1:
        return cls(layout, overlap=overlap, microbatches=microbatches, progress=progress)

    def _send(self, b: Bucket) -> torch.Tensor:
        return b.flat

    def _start(self, b: Bucket, thread) -> tuple:
        send = outgoing(self._send(b), b.group, self.layout.wire)
        recv = torch.empty_like(b.shard, dtype=send.dtype)  # added to the shard after the wait
        op = op_for(send, self.layout.wire)
        h = thread.reduce_scatter(b.group, send, recv, *op) if thread is not None \
            else b.group.ireduce_scatter(send, recv, *op)
        return h, recv

    def _sum(self) -> None:
        if self.overlap:
            super()._sum()
            return
        for b in self.buckets:  # one reduction at a time, as the blocking buckets
            self._post(b)
            self._wait_all()

    # -- prices (see GradSync) -----------------------------------------------------------
    @classmethod
    def memory(cls, cfg, P: int, ps: int, gathered) -> tuple[int, int]:
        """The parameters; the flat buffer and this rank's reduced shard, ``1/s`` of it
        (``s``: the shard group, dp x cp or HSDP's)."""
        ss = state_bytes(cfg)
        return P * ps, P * ss + P * ss // shard_size(cfg.topology)

    @classmethod
    def state_shards(cls, cfg) -> int:
        """The optimizer state is sharded over the shard group."""
        return shard_size(cfg.topology)

    @classmethod
    def hooks(cls, cfg) -> bool:
        return cfg.optim.overlap or super().hooks(cfg)

    @classmethod
    def posts(cls, cfg, nb: int, M: int) -> int:
        return nb if cfg.optim.overlap else 0

    @classmethod
    def reduce_scatters(cls, M: int) -> int:
        """Reduce-scatters of every bucket per step (``M`` microbatches)."""
        return 1

    @classmethod
    def gathers(cls, M: int) -> int:
        """All-gathers of the parameters per step: one, after the update."""
        return 1

    @classmethod
    def dp_bytes(cls, cfg, P: int, ps: int, M: int) -> int:
        """Reduce-scatters and all-gathers over the shard group of ``s``, and HSDP's
        all-reduce of the shards across the ``d/s`` groups."""
        t = cfg.topology
        d, s = t.dp * t.cp, shard_size(t)
        frac = (s - 1) / s
        return int((cls.reduce_scatters(M) + cls.gathers(M)) * P * ps * frac
                   + 2 * P * ps / s * (d - s) / d)

    @classmethod
    def dp_seconds(cls, net, P: int, nb: int) -> float:
        """The gradients reduce-scattered (:meth:`reduce_scatters`) and the parameters
        all-gathered once over the shard group, a collective's latencies per bucket, and
        HSDP's all-reduce across groups (``net.cross``)."""
        rs = cls.reduce_scatters(net.M)
        extra = (nb - 1) * (net.s - 1) * net.shard_link.latency
        return (rs * (net.scatter(P * net.gs) + extra) + net.scatter(P * net.ps)
                + extra + net.cross)


class Zero2(Zero1):
    """Per-microbatch staging buffers, reduce-scattered from the hooks (always overlapped)."""

    name = "zero2"
    zero_level = 2
    per_microbatch = True

    def __init__(self, layout, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, overlap=True, microbatches=microbatches, progress=progress)

    @classmethod
    def from_choices(cls, layout, *, microbatches: int = 1, progress: str = "test",
                     **_) -> Zero2:
        return cls(layout, microbatches=microbatches, progress=progress)

    def _accumulate(self, p: torch.Tensor) -> None:
        b, off = self.layout.where[id(p)]
        if b.staging is None:
            b.staging = torch.zeros(b.numel, dtype=shard_dtype(b.dtype), device=p.device)
        b.staging[off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def _send(self, b: Bucket) -> torch.Tensor:
        send = b.staging if b.staging is not None else b.shard.new_zeros(b.numel)
        b.staging = None  # freed when the reduction completes
        return send

    @classmethod
    def memory(cls, cfg, P: int, ps: int, gathered) -> tuple[int, int]:
        """The parameters; this rank's shard and one staging bucket (``optim.bucket_mb`` of
        parameter bytes, held in the shard dtype)."""
        ss = state_bytes(cfg)
        staging = min(P * ps, int(cfg.optim.bucket_mb * 2**20)) * ss // ps
        return P * ps, P * ss // shard_size(cfg.topology) + staging

    @classmethod
    def hooks(cls, cfg) -> bool:
        return True

    @classmethod
    def posts(cls, cfg, nb: int, M: int) -> int:
        """Every bucket every microbatch."""
        return nb * M

    @classmethod
    def reduce_scatters(cls, M: int) -> int:
        return M


# -- ZeRO-3 ----------------------------------------------------------------------------
def roots(chunk) -> tuple[list[str], list[str]]:
    """The parameter names of a chunk's two root units: (the embedding, whose backward is a
    scatter-add of the gradient and reads no weight; the head unit: final norm and head, and
    the embedding too when the head is tied to it). Either may be empty."""
    rest = [n for n, _ in chunk.named_parameters() if not n.startswith("blocks.")]
    tied = getattr(getattr(chunk, "cfg", None), "tie_embeddings", False)
    embed = [n for n in rest if n == "embed" and not tied]
    return embed, [n for n in rest if n not in embed]


def units_of(chunks) -> list[list[str]]:
    """Parameter names of each unit: chunks last first; in each, its blocks last first, then
    its head unit, then its embedding (:func:`roots`)."""
    out = []
    for chunk in reversed(chunks):
        for i, block in reversed(list(chunk.blocks.items())):
            out.append([f"blocks.{i}.{n}" for n, _ in block.named_parameters()])
        out += [names for names in reversed(roots(chunk)) if names]
    return out


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    s = t.untyped_storage()
    need = t.numel() * t.element_size()
    if s.nbytes() != need:
        s.resize_(need)


class Unit:
    """The buckets of one block (or a stage's root) and its gathered state."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.ids = {id(p) for b in buckets for p in b.params}
        self.handles: list = []  # a prefetch in flight
        self.gathered = False
        self.waiting: set = set()  # ids of parameters still without this backward's grad
        self.nbytes = sum(b.numel * b.full.element_size() for b in buckets)


class ShardedParams:
    """This rank's parameter shards and the hooks that gather and free them."""

    def __init__(self, chunks, grads):
        groups: dict = {}
        by_unit: dict[int, list] = {}
        for b in grads.buckets:
            if id(b.group) not in groups:  # gathers never share a communicator with the
                # reduce-scatters; recorded under the same axis (comm_dp, trace, watchdog)
                groups[id(b.group)] = b.group.dup(b.group.axis, b.group.recorder)
            b.gather_group = groups[id(b.group)]
            self._shard(b)
            by_unit.setdefault(b.unit, []).append(b)
        self.units = [Unit(by_unit[k]) for k in sorted(by_unit)]
        self._unit_of = {i: u for u in self.units for i in u.ids}
        self.live = self.peak = 0  # gathered bytes now, and the peak since take_peak
        self.storages: set[int] = set()  # data pointers of gathered full buffers
        self.mode = "full"  # or "inputs" during B of a split backward
        self._chunk_units: dict[int, list[Unit]] = {}  # id(chunk) -> units, backward order
        for chunk in chunks:
            self._attach(chunk)

    @torch.no_grad()
    def _shard(self, b) -> None:
        """Copy the parameters into a fresh full buffer, make them views of it, keep this
        rank's shard and free the buffer."""
        full = torch.zeros(b.numel, dtype=b.dtype, device=b.params[0].device)
        for p, off in zip(b.params, b.offsets):
            full[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = full[off:off + p.numel()].view_as(p)
        lo, hi = b.shard_range
        b.pshard, b.full = full[lo:hi].clone(), full
        _free(full)

    # -- gather / free ---------------------------------------------------------------------
    def prefetch(self, unit: Unit | None) -> None:
        """Post the unit's all-gathers (nonblocking) unless they are in flight. A gathered
        unit is gathered again: whether to communicate never depends on local state that
        could differ between the ranks of a group (e.g. an expert that got no tokens)."""
        if unit is None or unit.handles:
            return
        for b in unit.buckets:
            _alloc(b.full)
            self.storages.add(b.full.untyped_storage().data_ptr())
            unit.handles.append(b.gather_group.iallgather(b.pshard, b.full))
        if not unit.gathered:
            self.live += unit.nbytes
            self.peak = max(self.peak, self.live)
        unit.gathered = True

    def gather(self, unit: Unit) -> None:
        self.prefetch(unit)
        for h in unit.handles:
            h.wait()
        unit.handles = []

    def free(self, unit: Unit) -> None:
        if unit.handles:  # never leave a posted gather behind
            self.gather(unit)
        if unit.gathered:
            for b in unit.buckets:
                self.storages.discard(b.full.untyped_storage().data_ptr())
                _free(b.full)
            unit.gathered = False
            self.live -= unit.nbytes

    def free_all(self) -> None:
        for u in self.units:
            self.free(u)
            u.waiting = set()

    def take_peak(self) -> int:
        out, self.peak = self.peak, self.live
        return out

    def shard_bytes(self) -> int:
        """The parameter shards this rank holds for good."""
        return sum(b.pshard.numel() * b.pshard.element_size() for u in self.units
                   for b in u.buckets)

    # -- hooks -------------------------------------------------------------------------
    def _attach(self, chunk) -> None:
        params = dict(chunk.named_parameters())
        embed_names, head_names = roots(chunk)
        embed = self._unit_of[id(params[embed_names[0]])] if embed_names else None
        head = self._unit_of[id(params[head_names[0]])] if head_names else None
        # the unit the stage's forward reads first: its embedding (tied: the head unit)
        entry = self._unit_of[id(params["embed"])] if "embed" in params else None
        blocks = [self._unit_of[id(next(b.parameters()))] for b in chunk.blocks.values()]
        mine = {id(u): u for u in [*blocks, embed, head] if u is not None}
        self._chunk_units[id(chunk)] = [u for u in self.units if id(u) in mine]
        self._stage_hooks(chunk, entry, head, blocks)
        tail = head if head is not entry else None  # gathered after the last block
        for k, block in enumerate(chunk.blocks.values()):
            last = k + 1 == len(blocks)
            self._block_hooks(block, blocks[k], before=embed if k == 0 else None,
                              ahead=tail if last else blocks[k + 1],
                              then=tail if last else None,
                              after=head if last else blocks[k + 1],
                              behind=blocks[k - 1] if k else None)
        for p in chunk.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _stage_hooks(self, chunk, entry, head, blocks) -> None:
        """Forward: gather ``entry``, prefetch the first block; free the roots after. The
        loss (a stage with a head) gathers the head for its backward and prefetches the last
        block; another stage's output is its last block's, whose hook does the work."""

        def pre(_module, _args):
            if entry is not None:
                self.gather(entry)
            self.prefetch(blocks[0])

        def post(_module, _args, out):
            for unit in self._chunk_units[id(chunk)]:
                if unit not in blocks:
                    self.free(unit)
            if head is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(loss_grad)

        def loss_grad(grad):
            self._arrive(head)
            self.prefetch(blocks[-1])
            return grad

        chunk.register_forward_pre_hook(pre)
        chunk.register_forward_hook(post)

    def _block_hooks(self, block, unit, before, ahead, then, after, behind) -> None:
        """Forward: free ``before`` (the embedding: read before the first block only), gather
        ``unit``, prefetch ``ahead``; after it free ``unit`` and gather ``then`` (after the
        last block: the head). Backward (when the output's gradient is ready): gather
        ``unit``, free ``after`` (the unit the gradient has just left: its backward is done),
        prefetch ``behind``."""

        def pre(_module, _args):
            if before is not None:
                self.free(before)
            self.gather(unit)
            self.prefetch(ahead)

        def post(_module, _args, out):
            self.free(unit)
            if then is not None:
                self.gather(then)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(output_grad)

        def output_grad(grad):
            self._arrive(unit)
            if after is not None:
                self.free(after)
            self.prefetch(behind)
            return grad

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)

    def _arrive(self, unit) -> None:
        """The unit's backward is next: gather it; in a whole backward, free it once all its
        parameters have their gradient."""
        self.gather(unit)
        if self.mode == "full":
            unit.waiting = set(unit.ids)

    def _on_grad(self, p: torch.Tensor) -> None:
        unit = self._unit_of[id(p)]
        if unit.waiting:
            unit.waiting.discard(id(p))
            if not unit.waiting:
                self.free(unit)

    # -- the end of a backward -------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self, chunk, split: bool = False):
        """Around a backward of ``chunk`` (``split``: ``B`` of a zero-bubble schedule, which
        delivers no matmul weight gradient: units are freed by the output hooks only); the
        chunk's units are all freed after."""
        self.mode = "inputs" if split else "full"
        try:
            yield
        finally:
            self.mode = "full"
            for unit in self._chunk_units[id(chunk)]:
                self.free(unit)
                unit.waiting = set()

    def input_pass(self, chunk):
        """:meth:`backward_pass` of ``B``."""
        return self.backward_pass(chunk, split=True)


class Zero3(Zero2):
    """ZeRO-2's gradient shards over one bucket per unit (a layout built with
    :func:`units_of`), and the parameters sharded too: set-up shards them and installs the
    gather/free hooks on ``chunks`` (:class:`ShardedParams`, ``self.sharded``)."""

    name = "zero3"
    zero_level = 3
    shards_parameters = True  # gathers priced in the passes (planner.collectives.zero3_exposed)

    def __init__(self, layout, chunks, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, microbatches=microbatches, progress=progress)
        self.sharded = ShardedParams(chunks, self)

    @classmethod
    def units(cls, chunks) -> list:
        return units_of(chunks)

    @classmethod
    def from_choices(cls, layout, *, chunks: list, microbatches: int = 1,
                     progress: str = "test", **_) -> Zero3:
        return cls(layout, chunks, microbatches=microbatches, progress=progress)

    # -- prices (see GradSync) -----------------------------------------------------------
    @classmethod
    def memory(cls, cfg, P: int, ps: int, gathered) -> tuple[int, int]:
        """``1/s`` of the parameters and what is gathered at once; the gradient shard and
        the largest unit's staging."""
        ss, s = state_bytes(cfg), shard_size(cfg.topology)
        block, at_once = gathered()
        return P * ps // s + at_once * ps, P * ss // s + block * ss

    @classmethod
    def posts(cls, cfg, nb: int, M: int) -> int:
        """Priced with the gathers, in the passes."""
        return 0

    @classmethod
    def gathers(cls, M: int) -> int:
        """The stage gathered forward and backward per microbatch (a split backward's W
        reads no weight; the embedding, gathered forward only, counts twice: a bound)."""
        return 2 * M

    @classmethod
    def dp_seconds(cls, net, P: int, nb: int) -> float:
        """Only HSDP's all-reduce across groups: the gathers and reduce-scatters are in the
        passes."""
        return net.cross
