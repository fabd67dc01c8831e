"""The rules that end a run early, each with a reason: a target validation loss, no
improvement for ``train.patience`` evaluations, a wall-time budget (``train.max_wall_s``), and
the SLURM job's end time less a margin. ``train.py`` asks :meth:`StopRules.check` after every
step; the wall-time rules agree over the world with one all-reduce.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .job.slurm import parse_end_time


@dataclass
class StopRules:
    """When to end a run early, each with a reason: a target validation loss, no
    improvement for ``patience`` evaluations, or a wall-time budget (``train.max_wall_s``, and
    the SLURM job's end time less a margin of two mean steps and ``margin_s``)."""

    target_val_loss: float = 0.0
    patience: int = 0
    max_wall_s: float = 0.0
    job_end_epoch: float | None = None
    margin_s: float = 60.0

    def __post_init__(self):
        self.started = time.time()
        self.best = math.inf
        self.bad_evals = 0
        self.steps, self.step_s = 0, 0.0

    @classmethod
    def from_config(cls, tcfg, world, job_end_time=None) -> StopRules:
        """Collective: rank 0's view of the job's end time is shared, so every rank applies
        the same rules."""
        end = world.bcast_obj(parse_end_time(job_end_time))
        return cls(tcfg.target_val_loss, tcfg.patience, tcfg.max_wall_s, end,
                   tcfg.slurm_margin_s)

    def check(self, world, val_loss: float | None, step_s: float) -> str | None:
        """After each step: the reason to stop, or None. Collective over the world when a
        wall-time rule is active (every rank gets the same answer)."""
        self.steps += 1
        self.step_s += step_s
        reason = self.after_eval(val_loss) if val_loss is not None else None
        if reason is None and (self.max_wall_s or self.job_end_epoch):
            reason = self.wall_time(world, self.step_s / self.steps)
        return reason

    def after_eval(self, val_loss: float) -> str | None:
        """Identical on every rank (the loss is already reduced)."""
        if self.target_val_loss and val_loss <= self.target_val_loss:
            return f"target validation loss {self.target_val_loss} reached ({val_loss:.4f})"
        if val_loss < self.best:
            self.best, self.bad_evals = val_loss, 0
        else:
            self.bad_evals += 1
        if self.patience and self.bad_evals >= self.patience:
            return (f"no improvement of the validation loss for {self.bad_evals} evaluations "
                    f"(best {self.best:.4f})")
        return None

    def wall_time(self, world, mean_step_s: float) -> str | None:
        """Collective over the world: ranks agree (clocks differ) with one max-reduction."""
        now = time.time()
        code = 0.0
        if self.max_wall_s and now - self.started + mean_step_s > self.max_wall_s:
            code = 1.0
        if self.job_end_epoch and self.job_end_epoch - now < self.margin_s + 2 * mean_step_s:
            code = 2.0
        code = world.allreduce(code, "max")
        if code == 1.0:
            return f"wall-time budget train.max_wall_s={self.max_wall_s:g} s reached"
        if code == 2.0:
            return "the SLURM job's time limit is near; stopping cleanly before it"
        return None
