"""Numeric guard: a bad step does not reach the weights.

A step is *bad* when its loss or global gradient norm is not finite, or, with
``telemetry.loss_spike = X > 0``, when its loss exceeds X times the mean of the last
``window`` good losses. A bad step skips the optimizer update (its gradients are discarded,
the optimizer state is untouched) and is counted in ``metrics.jsonl`` (``skipped``,
``skips_total``). After ``telemetry.max_skips`` consecutive bad steps the guard either rolls
back to the last committed checkpoint (``on_skips = "rollback"``; training continues with
the next batch) or stops with :class:`NumericError` (``"stop"``, or when there is no
checkpoint to go back to).

Loss and gradient norm are global (reduced over the world), so every rank reaches the same
verdict and the collectives stay matched; the guard itself does no communication.
"""

from __future__ import annotations

import math
from collections import deque


class NumericError(RuntimeError):
    """Training cannot continue: too many consecutive non-finite or spiking steps."""


class NumericGuard:
    def __init__(self, tcfg, rollback=None, window: int = 20):
        """``tcfg``: the telemetry config section. ``rollback()``: restores the last
        checkpoint (collective) and returns its path, or None when there is none."""
        self.max_skips = tcfg.max_skips
        self.on_skips = tcfg.on_skips
        self.spike = tcfg.loss_spike
        self.rollback = rollback
        self.recent: deque = deque(maxlen=window)
        self.consecutive = 0
        self.total = 0
        self.rollbacks = 0
        self.last_reason = ""

    def verdict(self, loss: float, grad_norm: float) -> str:
        """Why this step is bad, or "" when it is fine. Pure."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if self.spike > 0 and self.recent:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike * mean:
                return f"loss {loss:.4g} > {self.spike:g} x recent mean {mean:.4g}"
        return ""

    def admit(self, loss: float, grad_norm: float, step: int) -> bool:
        """True: apply the update. False: skip it (counted); after ``max_skips`` consecutive
        skips roll back or raise :class:`NumericError`."""
        reason = self.verdict(loss, grad_norm)
        self.last_reason = reason
        if not reason:
            self.consecutive = 0
            self.recent.append(loss)
            return True
        self.consecutive += 1
        self.total += 1
        if self.max_skips and self.consecutive >= self.max_skips:
            where = None
            if self.on_skips == "rollback" and self.rollback is not None:
                where = self.rollback()
            if where is None:
                raise NumericError(
                    f"step {step}: {self.consecutive} consecutive bad steps (last: {reason}); "
                    + ("no checkpoint to roll back to" if self.on_skips == "rollback"
                       else "telemetry.on_skips = \"stop\"")
                    + ". Lower optim.lr, raise optim.warmup_steps or check the data.")
            self.rollbacks += 1
            self.consecutive = 0
            self.last_reason = f"{reason}; rolled back to {where}"
        return False

    def metrics(self) -> dict:
        """This step's verdict for ``metrics.jsonl``; resets it (one call per step, so a step
        that never reached :meth:`admit` reports no skip)."""
        reason, self.last_reason = self.last_reason, ""
        return {"skipped": bool(reason), "skips_total": self.total,
                "rollbacks": self.rollbacks, **({"skip_reason": reason} if reason else {})}
