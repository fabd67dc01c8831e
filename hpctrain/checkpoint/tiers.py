"""The run's checkpoints as the training loop sees them: one object over the two tiers, the
HDF5 file in global shapes (:class:`~hpctrain.checkpoint.checkpointer.Checkpointer`, every
``checkpoint.every`` steps, at the end and when stopping) and the node-local generations with
their partner copies (:class:`~hpctrain.checkpoint.local.LocalTier`, every
``checkpoint.local_every`` steps). Restore takes the freshest sound one; a step ends with
:meth:`Checkpoints.after_step`; their figures come out together."""

from __future__ import annotations

from pathlib import Path

from .checkpointer import Checkpointer
from .local import LocalTier


class Checkpoints:
    """Restore, save when due, poll, wait and the metrics of both tiers. Collective where
    the tiers are (every call but :meth:`watch` and :attr:`recovery`)."""

    def __init__(self, cfg, topo, directory: Path, total_steps: int, info=None, warn=None,
                 model=None):
        self.cfg, self.total = cfg, total_steps  # the [checkpoint] section, train.steps
        self.saver = Checkpointer(cfg, topo, directory, warn=warn, info=info, model=model)
        self.tier = LocalTier(cfg, topo, self.saver, info, warn)
        self.last_saved: Path | None = None  # the newest HDF5 file this run wrote

    @property
    def recovery(self) -> dict | None:
        """How the run started (tier, step, seconds, reshard) for summary.json."""
        return self.tier.recovery

    def restore(self, how: str, state, optimizer) -> dict | None:
        """``checkpoint.resume``: the freshest complete tier, or None for a fresh start."""
        return self.tier.restore(how, state, optimizer)

    def take_over(self, resumed: dict | None, start: int):
        """The run owns the directory from ``start`` on (Checkpointer.take_over)."""
        return self.saver.take_over(resumed, start)

    def roll_back(self, state, optimizer) -> str | None:
        """The numeric guard's rollback to the newest HDF5 checkpoint."""
        return self.tier.roll_back(state, optimizer)

    def watch(self, watchdog) -> None:
        """A background write that hangs is reported although steps go on."""
        watchdog.watch(self.saver.background_write)
        watchdog.watch(self.tier.background_write)

    def after_step(self, step: int, state, optimizer, attrs, *, stop: bool, timers) -> None:
        """The end of step ``step``: the saves in flight polled (a failure on any rank raises
        on every rank), a local generation and the HDF5 file written when due (``attrs()``
        gives what the file records), and with ``stop`` or at the last step both tiers
        waited for until committed."""
        c = self.cfg
        self.saver.poll()
        self.tier.poll()
        if self.tier.due(step):
            with timers("checkpoint"):
                self.tier.save(step, state, optimizer, attrs())
        last = step == self.total
        if (c.every and step % c.every == 0) or stop or (last and c.save_final):
            with timers("checkpoint"):
                self.last_saved = self.saver.save(step, state, optimizer, attrs())
        if stop or last:
            with timers("checkpoint"):
                self.wait()

    def wait(self) -> None:
        """No save left in flight."""
        self.saver.wait()
        self.tier.wait()

    def take_metrics(self) -> dict:
        """The figures of both tiers since the last call (ckpt_*, local_*)."""
        return {**self.saver.take_metrics(), **self.tier.take_metrics()}
