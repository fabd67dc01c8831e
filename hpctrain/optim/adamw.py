"""AdamW, the learning-rate schedule and global gradient-norm clipping.

AdamW is written out (rather than ``torch.optim``) so that its state is plain named tensors
with the parameter's global shape, which the checkpoint stores and reshards, and so that
ZeRO can shard it. Low-precision parameters (bfloat16, float16) keep float32 master weights
and read float32 gradients: the "main grads" that the gradient sync
(``parallel/grad_sync/``) accumulates and reduces (:func:`~.grad_sync.interface.main_grad`;
``p.grad`` itself for 32/64 bits), so the norm, clipping and update never see a gradient
rounded to 16 bits.

The global gradient norm counts each parameter exactly once (invariant 2): a parameter
contributes on this rank only if this rank holds a distinct piece of it, i.e. it is the
first replica along every axis over which the parameter is replicated. One all-reduce over
the world sums the pieces. (Averaging per-group norms, as one well-known framework does under
expert parallelism, is wrong.)
"""

from __future__ import annotations

import math

import torch

from ..config import OptimConfig
from ..config.derived import lr_at  # noqa: F401  (the schedule the optimizer follows)
from ..parallel.grad_sync.interface import main_grad


def counted_here(meta, topo, grads_sharded_over_dp: bool = False) -> bool:
    """Whether this rank's gradient piece of a parameter enters the global norm."""
    if meta.tp_dim is None and topo.tp_rank != 0:
        return False  # replicated over tp: count the copy on tp rank 0
    if grads_sharded_over_dp:
        return True
    if meta.expert_dim is not None:
        return topo.edpcp_comm.rank == 0  # experts are replicated over edp (and cp) only
    return topo.dpcp_comm.rank == 0  # dense: over dp (and cp)


def global_grad_norm(named_params, topo, grads_sharded_over_dp: bool = False) -> float:
    """L2 norm of the whole model's gradient, each parameter counted once. Collective over
    the world communicator."""
    named_params = list(named_params)
    device = named_params[0][1].device if named_params else "cpu"
    local = torch.zeros((), dtype=torch.float64, device=device)
    for _, p in named_params:
        g = main_grad(p)
        if g is not None and counted_here(p.hp, topo, grads_sharded_over_dp):
            local += g.detach().double().pow(2).sum()
    return math.sqrt(topo.world.allreduce(float(local)))


@torch.no_grad()
def clip_(named_params, max_norm: float, norm: float) -> float:
    """Scale gradients so that the global norm is at most ``max_norm``; returns the scale."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    scale = max_norm / (norm + 1e-6)
    for _, p in named_params:
        g = main_grad(p)
        if g is not None:
            g.mul_(scale)
    return scale


class LossScaler:
    """Dynamic loss scaling for float16: the loss is multiplied by ``scale`` before backward;
    a step whose gradient is not finite is skipped and the scale halved; after
    ``growth_interval`` good steps in a row it doubles. Disabled: scale 1, never skips."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 100):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps, self.skipped = 0, 0

    def update(self, finite: bool) -> bool:
        """Record a step's outcome; True when the step should be applied."""
        if not self.enabled:
            return True
        if not finite:
            self.scale, self.good_steps, self.skipped = self.scale / 2, 0, self.skipped + 1
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

    def metrics(self) -> dict:
        return {"loss_scale": self.scale, "skipped_steps": self.skipped} if self.enabled else {}

    def state_dict(self) -> dict:
        """What a checkpoint records (plain numbers): the scale, the growth tracker (good
        steps in a row) and the skipped-step count. Empty when disabled."""
        if not self.enabled:
            return {}
        return {"scale": float(self.scale), "good_steps": int(self.good_steps),
                "skipped": int(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s record; an empty record (a checkpoint made
        without float16) or a disabled scaler keeps the current state."""
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])


class ScaledOptimizer:
    """The loss-scaling interface train.py uses, shared by AdamW and ZeroAdamW (which set
    ``self.scaler``)."""

    scaler: LossScaler

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scaler_admits(self, norm: float) -> bool:
        """float16: False for a non-finite gradient (the step is skipped, the loss scale
        halved: expected, not a fault). Always True otherwise."""
        return self.scaler.update(math.isfinite(norm))

    def metrics(self) -> dict:
        return self.scaler.metrics()


class AdamW(ScaledOptimizer):
    """Decoupled weight decay on matrices (ndim >= 2); norms are not decayed.

    ``state[name] = {"exp_avg", "exp_avg_sq"[, "master"]}``; ``step_count`` is global.
    """

    def __init__(self, named_params, ocfg: OptimConfig, topo=None, scaler=None):
        self.cfg, self.topo = ocfg, topo
        self.scaler = scaler or LossScaler(enabled=False)
        self.params = list(named_params)
        self.step_count = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params:
            st_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            st = {"exp_avg": torch.zeros_like(p, dtype=st_dtype),
                  "exp_avg_sq": torch.zeros_like(p, dtype=st_dtype)}
            if p.dtype not in (torch.float32, torch.float64):
                st["master"] = p.detach().to(torch.float32).clone()
            self.state[name] = st

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Unscale the gradients (float16), then their global norm. Collective (world)."""
        if self.scaler.enabled:
            for _, p in self.params:
                g = main_grad(p)
                if g is not None:
                    g.mul_(1.0 / self.scaler.scale)
        return global_grad_norm(self.params, self.topo)

    def clip_and_step(self, lr: float, norm: float) -> None:
        clip_(self.params, self.cfg.grad_clip, norm)
        self.step(lr)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        c = self.cfg
        self.step_count += 1
        t = self.step_count
        bc1, bc2 = 1 - c.beta1**t, 1 - c.beta2**t
        for name, p in self.params:
            g = main_grad(p)
            if g is None:
                continue
            st = self.state[name]
            w = st.get("master", p)
            g = g.to(w.dtype)  # float32 main grads of 16-bit parameters: no copy
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            if c.weight_decay and p.dim() >= 2:
                w.mul_(1 - lr * c.weight_decay)
            denom = (v / bc2).sqrt_().add_(c.eps)
            w.addcdiv_(m, denom, value=-lr / bc1)
            if w is not p:
                p.copy_(w)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.state.values()
                   for t in st.values())
