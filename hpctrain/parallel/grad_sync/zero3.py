"""ZeRO-3: parameters sharded like their gradients and optimizer state, gathered per block.

With ``optim.zero = 3`` the strategy :class:`Zero3` cuts one bucket per
*unit* and reduction group (:func:`units_of`: every block of a stage, and the stage's
embedding / final norm / head as its "root" unit; a block's expert weights form a second
bucket over ``edp_comm``). :class:`ShardedParams` then keeps, per bucket, only this rank's
contiguous shard of the flattened parameters (``bucket.pshard``, the model dtype; padded
like the gradient shard) and a full buffer ``bucket.full`` whose storage exists only while
the unit is gathered. Every parameter is a view into its bucket's full buffer (``p.data``),
so the model code is unchanged: autograd saves the views, and the storage under them is
freed after use and all-gathered again before the backward.

Events (module hooks, no model change; the forward of a stage is always a module call):

- stage forward pre-hook: gather the root unit, prefetch the first block (``iallgather``);
- block forward pre-hook: gather the block (wait for its prefetch), prefetch the next one;
  forward post-hook: free the block (the stage's post-hook frees the root);
- the output of a block or stage that requires grad gets a tensor hook, which fires when its
  gradient is complete, i.e. just before the unit's backward: gather the unit again and
  prefetch the unit whose backward comes next (the previous block);
- every parameter's post-accumulate-grad hook: once all parameters of a unit have their
  gradient of this backward, the unit is freed. :class:`Zero3` (ZeRO-2's hooks,
  ``sharded.Zero2``) has already moved the gradient into the unit's staging bucket and
  reduce-scatters it as soon as the whole unit is done. :meth:`Zero3.reduce` frees whatever
  is left.

Every gather is issued on every rank of the group at the same point of the same program
(forward calls and gradient-ready hooks of the same graph), on a duplicate of the group's
communicator, so its order never mixes with the gradient reduce-scatters' on the group.

Pipeline parallelism gathers per microbatch: each forward and each backward action gathers
the blocks it runs and frees them after (two all-gathers of the stage per microbatch, the
memory of one unit at a time); see docs/parallelism.md for the choice.

Zero-bubble schedules split a stage's backward into ``B`` (everything but the weight
matmuls) and ``W`` (those matmuls' weight gradients, later; ``pipeline.runner.input_grad``). B
delivers no gradient to the matmul weights, so the "all gradients arrived" rule above never
frees a unit during B; the runner therefore wraps B in :meth:`ShardedParams.input_pass`: the
output hooks gather each unit as before and free the unit the input gradient has just left
(its part of B is done); nothing of the chunk stays gathered after B. W computes
``grad_out^T @ input`` from what B kept and reads no weight: it gathers nothing (two gathers
of the stage per microbatch, as 1F1B); its gradients reach the staging buckets through the
same post-accumulate hooks.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .sharded import Zero2


def units_of(chunks) -> list[list[str]]:
    """Parameter names of each unit, in backward order: chunks last first; in each, its
    blocks last first, then its root (embedding, final norm, head)."""
    out = []
    for chunk in reversed(chunks):
        for i, block in reversed(list(chunk.blocks.items())):
            out.append([f"blocks.{i}.{n}" for n, _ in block.named_parameters()])
        root = [n for n, _ in chunk.named_parameters() if not n.startswith("blocks.")]
        if root:
            out.append(root)
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
        self._prev: tuple | None = None  # inputs: (unit B passed through last, its tensor)
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
        blocks = [self._unit_of[id(next(b.parameters()))] for b in chunk.blocks.values()]
        rest = [p for n, p in chunk.named_parameters() if not n.startswith("blocks.")]
        root = self._unit_of[id(rest[0])] if rest else None
        first = blocks[0] if blocks else None
        last = blocks[-1] if blocks else None
        self._hooks(chunk, root, ahead=first, behind=last)
        mine = {id(u): u for u in [*blocks, root] if u is not None}
        self._chunk_units[id(chunk)] = [u for u in self.units if id(u) in mine]
        for k, block in enumerate(chunk.blocks.values()):
            ahead = blocks[k + 1] if k + 1 < len(blocks) else None
            behind = blocks[k - 1] if k else None
            self._hooks(block, blocks[k], ahead, behind)
        for p in chunk.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _hooks(self, module, unit, ahead, behind) -> None:
        """Forward: gather ``unit``, prefetch ``ahead``, free after. Backward (when the
        output's gradient is ready): gather ``unit``, prefetch ``behind``."""

        def pre(_module, _args):
            if unit is not None:
                self.gather(unit)
            self.prefetch(ahead)

        def post(_module, _args, out):
            if unit is not None:
                self.free(unit)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(functools.partial(backward, key=id(out)))

        def backward(grad, key):
            if unit is not None:
                self.gather(unit)
                if self.mode == "inputs":  # B: the unit it left is done (no weight grads)
                    # (a first stage's output is also its last block's: both hooks fire on
                    # one tensor, before that block's backward, which must keep its unit)
                    if self._prev is not None and self._prev[1] != key:
                        if self._prev[0] is not unit:
                            self.free(self._prev[0])
                        self._prev = None
                    if self._prev is None:
                        self._prev = (unit, key)
                else:
                    unit.waiting = set(unit.ids)
            self.prefetch(behind)
            return grad

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def _on_grad(self, p: torch.Tensor) -> None:
        unit = self._unit_of[id(p)]
        if unit.waiting:
            unit.waiting.discard(id(p))
            if not unit.waiting:
                self.free(unit)


    # -- split backward (zero-bubble schedules) --------------------------------------------
    @contextlib.contextmanager
    def input_pass(self, chunk):
        """Around ``B`` of ``chunk``: the hooks free each unit once the input gradient has
        left it; the chunk's units are all freed after."""
        self.mode, self._prev = "inputs", None
        try:
            yield
        finally:
            self.mode, self._prev = "full", None
            for unit in self._chunk_units[id(chunk)]:
                self.free(unit)
                unit.waiting = set()


class Zero3(Zero2):
    """ZeRO-2's gradient shards over one bucket per unit (a layout built with
    :func:`units_of`), and the parameters sharded too: set-up shards them and installs the
    gather/free hooks on ``chunks`` (:class:`ShardedParams`, ``self.sharded``)."""

    name = "zero3"
    zero_level = 3

    def __init__(self, layout, chunks, *, microbatches: int = 1, progress: str = "test"):
        super().__init__(layout, microbatches=microbatches, progress=progress)
        self.sharded = ShardedParams(chunks, self)
