"""ZeRO-1/2/3: AdamW on this rank's shard of every gradient bucket.

A sharded gradient sync (:class:`~hpctrain.parallel.grad_sync.GradSync` with ``zero_level``
1-3: ``grad_sync/sharded.py``) leaves in each bucket the
reduced gradient of this rank's contiguous shard (``bucket.shard``, float32, or float64 for
float64 models). :class:`ZeroAdamW` keeps, for that shard only, the Adam moments and, for
16-bit parameters, the float32 master weights, updates the shard, and all-gathers the updated
values back into every replica of the parameters. Dense buckets shard over ``topo.dpcp_comm``,
expert buckets over ``topo.edpcp_comm`` (each bucket carries its group). With HSDP
(``topology.shard_within``) a bucket's group is a shard group inside those and its
``replica`` group holds identical copies of the shard: every copy takes the same step, the
norm counts the copy in the first shard group, a checkpoint is written from it
(:meth:`writes_shard`).

Memory per rank for Ψ parameters over a group of d ranks: zero 0 keeps 2Ψ moments (+Ψ fp32
master for 16-bit parameters); ZeRO keeps them divided by d (plus one bucket of padding).
The update is element-wise identical to :class:`~hpctrain.optim.adamw.AdamW`; only the order of the
gradient sum over ranks differs, so ZeRO equals plain data parallelism to rounding.

The gradient norm sums every rank's shard (each element of a parameter lives in exactly one
shard of its group) and counts tp-replicated parameters on tp rank 0 only (invariant 2),
summing on the shards' device (one number crosses to the host for the world all-reduce).

ZeRO-3 (``grad_sync/sharded.py``): the parameters are sharded too. The update writes this rank's
shard of the parameters (``bucket.pshard``; for float32/float64 it IS the updated tensor, for
16-bit models the float32 master is rounded into it) and nothing is all-gathered after the
step: the next forward gathers each block when it needs it. :meth:`param_shard` gives
checkpoints the parameter elements of the shard, written and read like the moments.

Checkpoints never gather the state: each rank saves and loads its own shards as hyperslabs of
the global datasets (:meth:`ZeroAdamW.local_state`, :meth:`ZeroAdamW.flat_shard`,
``checkpoint/layout.py``), and a load writes straight into the shards.
"""

from __future__ import annotations

import math

import torch

from ..parallel.grad_sync import GradSync, shard_dtype
from .adamw import AdamW, LossScaler, ScaledOptimizer, counted_here

_LOW = (torch.bfloat16, torch.float16)


def build_optimizer(named_params, ocfg, topo, grads: GradSync, dtype: str):
    """AdamW (the grad sync's ``zero_level`` 0) or ZeroAdamW (1-3, on its shards) with the
    dtype's loss scaler."""
    scaler = LossScaler(enabled=(dtype == "float16"), init_scale=ocfg.loss_scale)
    if grads.zero_level:
        return ZeroAdamW(grads, ocfg, topo, scaler)
    return AdamW(named_params, ocfg, topo=topo, scaler=scaler)


class ZeroAdamW(ScaledOptimizer):
    """Sharded AdamW. Checkpoints read and write each rank's shards in place
    (:meth:`local_state`, :meth:`flat_shard`); ``state`` is a gathered copy (collective)."""

    def __init__(self, grads: GradSync, ocfg, topo, scaler: LossScaler | None = None):
        self.cfg, self.grads, self.topo = ocfg, grads, topo
        self.scaler = scaler or LossScaler(enabled=False)
        self.params = grads.named
        self.step_count = 0
        self.zero3 = grads.zero_level == 3
        self._masks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (decay, counted)
        self.shards = [self._init_shard(b) for b in grads.buckets]
        self._ranges = {n: (plo, phi) for _, n, _, _, plo, phi in self._overlaps()}
        self._pshards = {n: b.pshard[lo:hi] for b, n, lo, hi in self._bucket_overlaps()
                         if b.pshard is not None}
        self._writers = {n: b.replica is None or b.replica.rank == 0
                         for b in grads.buckets for n in b.names}

    def _init_shard(self, b) -> dict[str, torch.Tensor]:
        lo, hi = b.shard_range
        dt, dev = shard_dtype(b.dtype), b.shard.device
        st = {"exp_avg": torch.zeros(hi - lo, dtype=dt, device=dev),
              "exp_avg_sq": torch.zeros(hi - lo, dtype=dt, device=dev)}
        decay = torch.zeros(hi - lo, dtype=dt, device=dev)
        counted = torch.zeros(hi - lo, dtype=torch.bool, device=dev)
        first = b.replica is None or b.replica.rank == 0  # HSDP: one copy of the shard counts
        for p, a, e, _, _ in self.grads.segments(b):
            decay[a:e] = 1.0 if p.dim() >= 2 else 0.0
            counted[a:e] = first and counted_here(p.hp, self.topo, grads_sharded_over_dp=True)
        if b.dtype in _LOW:
            st["master"] = self._gather_params(b, dt)
        self._masks.append((decay, counted))
        return st

    def _gather_params(self, b, dt) -> torch.Tensor:
        """This rank's shard of the bucket's current parameter values, as ``dt``."""
        if b.pshard is not None:  # zero 3
            return b.pshard.to(dt, copy=True)
        lo, hi = b.shard_range
        w = torch.zeros(hi - lo, dtype=dt, device=b.shard.device)
        for p, a, e, plo, phi in self.grads.segments(b):
            w[a:e] = p.detach().reshape(-1)[plo:phi].to(dt)
        return w

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Unscale the shards (float16), then the global norm. Collective over the world."""
        if self.scaler.enabled:
            for b in self.grads.buckets:
                b.shard.mul_(1.0 / self.scaler.scale)
        device = self.grads.buckets[0].shard.device if self.grads.buckets else "cpu"
        local = torch.zeros((), dtype=torch.float64, device=device)  # on the shards' device
        for b, (_, counted) in zip(self.grads.buckets, self._masks):
            local += torch.where(counted, b.shard.double().pow(2), 0.0).sum()
        return math.sqrt(self.topo.world.allreduce(float(local)))

    @torch.no_grad()
    def clip_and_step(self, lr: float, norm: float) -> None:
        """Clip the shards, update them, all-gather the parameters. Collective over every
        bucket's group."""
        c = self.cfg
        if c.grad_clip > 0 and math.isfinite(norm) and norm > c.grad_clip:
            for b in self.grads.buckets:
                b.shard.mul_(c.grad_clip / (norm + 1e-6))
        self.step_count += 1
        for b, st, (decay, _) in zip(self.grads.buckets, self.shards, self._masks):
            self._update(b, st, decay, lr)
            self._allgather_params(b, st)

    def _update(self, b, st, decay, lr: float) -> None:
        c, t = self.cfg, self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        if "master" in st:
            w = st["master"]
        else:  # zero 3: the parameter shard itself; zero 1/2: a copy from the parameters
            w = b.pshard if self.zero3 else self._gather_params(b, b.shard.dtype)
        g, m, v = b.shard, st["exp_avg"], st["exp_avg_sq"]
        m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        if c.weight_decay:
            w.mul_(1 - lr * c.weight_decay * decay)
        denom = (v / bc2).sqrt_().add_(c.eps)
        w.addcdiv_(m, denom, value=-lr / bc1)
        st["_w"] = w

    def _allgather_params(self, b, st) -> None:
        """Every rank's updated shard -> the full bucket -> the parameters (one bucket of
        temporary memory). Collective over ``b.group``."""
        w = st.pop("_w")
        if self.zero3:  # no gather: the next forward gathers each block
            if w is not b.pshard:
                b.pshard.copy_(w)
            return
        full = torch.empty(b.numel, dtype=b.dtype, device=w.device)
        b.group.allgather(w.to(b.dtype), full)
        for p, off in zip(b.params, b.offsets):
            p.copy_(full[off:off + p.numel()].view_as(p))

    # -- checkpoint interface ---------------------------------------------------------
    def _overlaps(self):
        """(bucket state, name, shard lo, shard hi, param lo, param hi) for each parameter
        that overlaps this rank's shard (see GradSync.segments)."""
        for b, st in zip(self.grads.buckets, self.shards):
            names = {id(p): n for n, p in zip(b.names, b.params)}
            for p, lo, hi, plo, phi in self.grads.segments(b):
                yield st, names[id(p)], lo, hi, plo, phi

    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """What checkpoints save and load, without communication: for each parameter that
        overlaps this rank's shard, 1-D *views* of the shard's state holding its flattened
        elements :meth:`flat_shard` ``(a, b)``. A load writes straight into the shards."""
        return {name: {key: t[lo:hi] for key, t in st.items()}
                for st, name, lo, hi, _, _ in self._overlaps()}

    def _bucket_overlaps(self):
        for b in self.grads.buckets:
            names = {id(p): n for n, p in zip(b.names, b.params)}
            for p, lo, hi, _, _ in self.grads.segments(b):
                yield b, names[id(p)], lo, hi

    def param_shard(self, name: str) -> torch.Tensor | None:
        """Zero 3: the 1-D view of this rank's parameter shard holding the flattened local
        parameter ``name``'s elements :meth:`flat_shard` (a checkpoint writes and reads the
        parameter there); None for zero 1/2 or when the shard holds none of it."""
        return self._pshards.get(name)

    def writes_shard(self, name: str) -> bool:
        """Whether this rank writes its shard of ``name`` to a checkpoint: always, except
        with HSDP, where the copy in the first shard group does (every copy reads)."""
        return self._writers.get(name, True)

    def flat_shard(self, name: str) -> tuple[int, int] | None:
        """[a, b) of the flattened local parameter ``name`` held in this rank's shard."""
        return self._ranges.get(name)

    @property
    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole state in each parameter's local shape: a *copy* gathered over every
        bucket's group (collective; diagnostics and tests). Checkpoints use
        :meth:`local_state`, which never gathers."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b, st in zip(self.grads.buckets, self.shards):
            for key, shard in st.items():
                full = torch.empty(b.numel, dtype=shard.dtype, device=shard.device)
                b.group.allgather(shard, full)
                for name, p, off in zip(b.names, b.params, b.offsets):
                    out.setdefault(name, {})[key] = full[off:off + p.numel()].view_as(p)
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.shards for t in st.values())
