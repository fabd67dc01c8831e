"""The faults that act inside a training step (``kill``, ``stall``, ``poison``, ``slow``,
``raise``: :mod:`hpctrain.faults` has the syntax and every kind), between the local backward
and the gradient reduction, where the other ranks are about to enter a collective. For tests
and fault campaigns only. Not collective.
"""

from __future__ import annotations

import time

from .. import faults
from ..parallel.grad_sync.interface import main_grad

IN_STEP = ("kill", "stall", "poison", "slow", "raise")


class Faults:
    """The faults that concern this rank."""

    def __init__(self, spec: str, world_rank: int):
        """``spec``: ``experimental.faults``; the environment's are added (faults.install,
        which also hands the checkpoint code its faults)."""
        self.mine = [f for f in faults.install(spec)
                     if f.kind in IN_STEP and f.rank in (None, world_rank)]
        self.rank = world_rank

    def __bool__(self) -> bool:
        return bool(self.mine)

    def inject(self, step: int, named_params, timers) -> None:
        """Apply this rank's faults for 1-based ``step``."""
        for f in self.mine:
            if f.kind == "slow" and step >= (f.step or 0):
                with timers("compute"):
                    time.sleep(f.seconds)
            if f.step not in (None, step) or not f.claim():
                continue
            if f.kind == "kill":
                faults.die(f"rank {self.rank} killed in step {step}")
            elif f.kind == "stall":
                with timers("compute"):
                    time.sleep(f.seconds or 3600)
            elif f.kind == "poison":
                grads = [g for g in (main_grad(p) for _, p in named_params) if g is not None]
                if not grads:
                    raise RuntimeError("poison fault: no gradient buffer to poison (optim.zero=2 "
                                       "and 3 keep gradients in shards)")
                grads[0].view(-1)[0] = float("nan")  # what the optimizer reads
            elif f.kind == "raise":
                raise RuntimeError(f"injected fault: rank {self.rank} raises at step {step}")
