"""Collectives that progress while Python computes: a thread that owns a duplicate of one or
more :class:`Group` communicators and runs their *blocking* collectives in the order they
were posted.

Why: Open MPI's nonblocking collectives (libnbc) advance only inside MPI calls, and a rank
busy in autograd makes none, so an ``Iallreduce`` posted during backward mostly runs when
backward has ended (docs/results.md, "Overlapped gradient reduction"). The thread is inside MPI
for the whole transfer (mpi4py releases the GIL there), and it uses the tuned blocking
algorithms. Every rank posts the same sequence of operations, so the threads of a group
call the same collectives in the same order on their private communicators (needs
``MPI_THREAD_MULTIPLE``, which mpi4py requests: the main thread keeps talking MPI on the
other communicators).

Each post returns a :class:`Handle` whose ``wait()`` blocks until the thread has finished
that operation and records, in the caller's :class:`Recorder`, only the time waited (the
exposed time).
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

from mpi4py import MPI

from .group import Group, Handle
from .records import Recorder

if TYPE_CHECKING:
    import torch


class _ThreadRequest:
    """What :class:`Handle` needs of a request, completed by the progress thread."""

    def __init__(self):
        self.event = threading.Event()
        self.error: BaseException | None = None

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"collective on the progress thread failed: "
                               f"{self.error}") from self.error

    def Test(self) -> bool:  # noqa: N802 - mirrors MPI.Request
        done = self.event.is_set()
        if done:
            self._check()
        return done

    def Wait(self) -> None:  # noqa: N802
        self.event.wait()
        self._check()


class ProgressThread:
    """A thread running collectives on duplicates of ``groups`` (``Group.dup``, collective
    over each group, in the order given: the same on every rank), first posted first.

    ``poll_s = 0``: each operation is the blocking collective, one at a time (the thread is
    inside MPI, spinning, from post to completion). ``poll_s > 0``: the thread posts each as
    a nonblocking collective and drives all outstanding ones with ``MPI_Test`` every
    ``poll_s`` seconds, sleeping in between (less CPU taken from the computing thread)."""

    def __init__(self, groups: list[Group], poll_s: float = 0.0):
        provided = MPI.Query_thread()
        if provided != MPI.THREAD_MULTIPLE:
            raise RuntimeError("the progress thread needs MPI_THREAD_MULTIPLE "
                               f"(MPI provides level {provided})")
        quiet = Recorder()  # the thread's own calls; the caller's recorder gets the waits
        self._dups = {id(g): g.dup(f"{g.axis}-progress", quiet) for g in groups}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.poll_s = poll_s
        self._thread = threading.Thread(target=self._poll if poll_s else self._run,
                                        daemon=True, name="hpctrain-progress")
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            blocking, _, req = job
            try:
                blocking()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                req.error = e
            req.event.set()

    def _poll(self) -> None:
        active, stop = [], False  # (posted handle, request) in flight
        while not (stop and not active):
            try:
                job = self._jobs.get(timeout=None if not active else self.poll_s)
                if job is None:
                    stop = True
                else:
                    active.append((job[1](), job[2]))
                    continue  # post everything queued before testing
            except queue.Empty:
                pass
            for pair in list(active):
                handle, req = pair
                try:
                    done = handle.test()
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    req.error, done = e, True
                if done:
                    req.event.set()
                    active.remove(pair)

    def _post(self, group: Group, op: str, nbytes: int, blocking, nonblocking,
              keep) -> Handle:
        rec = group.recorder.post(op, group.axis, -1, nbytes)
        req = _ThreadRequest()
        self._jobs.put((blocking, nonblocking, req))
        return Handle(group.recorder, req, rec, keep=keep)

    def allreduce_(self, group: Group, t: torch.Tensor, op: str = "sum") -> Handle:
        """In-place sum over ``group`` (``op``: as :meth:`Group.allreduce_`); ``t`` is valid
        after ``wait()``."""
        dup = self._dups[id(group)]
        return self._post(group, "allreduce (progress thread)", t.nbytes,
                          lambda: dup.allreduce_(t, op), lambda: dup.iallreduce_(t, op), t)

    def reduce_scatter(self, group: Group, send: torch.Tensor, recv: torch.Tensor,
                       op: str = "sum") -> Handle:
        """:meth:`Group.reduce_scatter` of ``send`` into ``recv`` over ``group``."""
        dup = self._dups[id(group)]
        return self._post(group, "reduce_scatter (progress thread)", send.nbytes,
                          lambda: dup.reduce_scatter(send, recv, op),
                          lambda: dup.ireduce_scatter(send, recv, op), (send, recv))

    def call(self, groups: list[Group], fn, nbytes: int, keep, op: str = "call") -> Handle:
        """``fn(*dups)`` on the thread, given its duplicates of ``groups`` (each among the
        thread's): a sequence of blocking collectives, e.g. a two-level reduction. The
        blocking thread only (``poll_s = 0``). ``keep``: the tensors ``fn`` works on, held
        until the wait; ``nbytes`` and ``op`` are what the recorder is told."""
        if self.poll_s:
            raise ValueError("ProgressThread.call runs blocking sequences: poll_s must be 0")
        dups = [self._dups[id(g)] for g in groups]
        return self._post(groups[0], f"{op} (progress thread)", nbytes, lambda: fn(*dups),
                          None, keep)

    def close(self) -> None:
        """Stop the thread after the operations already posted."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
