"""Asynchronous saves (``checkpoint.async = true``): the step copies this rank's pieces into
host memory (write.snapshot), then a writer thread writes and commits the file while
training goes on.

Why a thread and not a helper process per node: h5py releases the GIL while HDF5 writes,
zlib releases it while computing CRCs and mpi4py while in MPI calls, so the thread costs the
training loop almost nothing but the copy (docs/checkpoints.md); a helper process
would need the snapshot copied once more into shared memory and an MPI job of its own for
the collective HDF5 open, without making the step's part smaller. The thread talks MPI only
on a duplicate of the world communicator (``Group.dup``), which needs
``MPI_THREAD_MULTIPLE``; where MPI does not provide it the Checkpointer saves synchronously
and logs why.

One writer thread per :class:`InFlight`, started with it and idle between saves: a save
hands it the snapshot through a queue, so the step does not wait for a new thread to be
scheduled (on busy cores that took up to 7 ms of a 2-10 ms blocked time).

At most one save is in flight. :meth:`InFlight.poll` is collective over the training world:
every rank says whether its thread is running, done or failed, so all ranks reach the same
verdict at the same step; a failure on any rank raises :class:`CheckpointFailed` on every
rank, and since the commit (rename, then ``latest``) is the write's last act, ``latest``
still names the previous checkpoint.
"""

from __future__ import annotations

import queue
import threading
import time


class CheckpointFailed(RuntimeError):
    """A background save failed on some rank; raised on every rank."""


class InFlight:
    """The one background save (or none) and the agreement about its end."""

    def __init__(self, writer, world, what: str = "the background save",
                 kept: str = "nothing was committed, `latest` names the previous checkpoint"):
        self.writer, self.world = writer, world  # writer on a duplicate; world: training's
        self.what, self.kept = what, kept  # the failure's words
        self.busy = False  # a save was started and its end not yet agreed on
        self.step, self.started = 0, 0.0
        self._outcome: tuple | None = None
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        threading.Thread(target=self._serve, daemon=True, name="hpctrain-ckpt-writer").start()

    def start(self, snap) -> None:
        assert not self.busy, "one background save at a time"
        self.step, self._outcome, self.started = snap.step, None, time.perf_counter()
        self.busy, self._done = True, threading.Event()  # this save's own end
        self._todo.put((snap, self._done))

    def _serve(self) -> None:
        while True:
            snap, done = self._todo.get()
            self._run(snap)
            done.set()

    def _run(self, snap) -> None:
        t0 = time.perf_counter()
        try:
            metrics = self.writer.write(snap)
            metrics["ckpt_background_s"] = time.perf_counter() - t0
            self._outcome = ("ok", metrics)
        except BaseException as e:  # noqa: BLE001 - reported on every rank by poll()
            self._outcome = ("failed", f"{type(e).__name__}: {e}")

    def running(self) -> tuple[float, str] | None:
        """(perf_counter at its start, what) while this rank's write runs, else None: the
        watchdog fires when it runs longer than a checkpoint may (telemetry/watchdog.py),
        since the training loop's progress says nothing about it. Any thread."""
        if not self.busy or self._outcome is not None:
            return None
        return self.started, f"the background write of checkpoint step {self.step}"

    def _state(self) -> str:
        if self._outcome is None:
            return "running"
        return "failed" if self._outcome[0] == "failed" else "done"

    def poll(self, block: bool) -> dict | None:
        """Collective over the training world. {} when nothing is in flight; None while
        some rank still writes (``block``: wait until none does); the save's metrics once
        every rank is done. Raises CheckpointFailed on every rank when any rank failed."""
        if not self.busy:
            return {}
        while True:
            states = self.world.allgather_obj(
                (self._state(), self._outcome[1] if self._state() == "failed" else ""))
            failed = [(r, why) for r, (s, why) in enumerate(states) if s == "failed"]
            if failed:  # this rank's thread may stay blocked in the failed write's MPI
                self.busy = False
                r, why = failed[0]
                raise CheckpointFailed(
                    f"{self.what} of step {self.step} failed on rank {r} ({why}); "
                    f"{self.kept}")
            if all(s == "done" for s, _ in states):
                self._done.wait()
                self.busy = False
                return {**self._outcome[1], "ckpt_async_step": self.step}
            if not block:
                return None
            if self._outcome is None:  # wait for this rank's own write without MPI
                self._done.wait()
            else:  # for the other ranks'
                time.sleep(0.005)
