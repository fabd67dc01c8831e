"""Never hang silently (invariant 5): a watchdog thread per rank.

From the first step to the end of training, a daemon thread wakes every ``poll`` seconds (1 s
at most) and checks whether this rank has made no progress for the limit (progress: a timer
phase, a schedule action or a communication completed; so a long step that keeps moving is
fine, one stuck phase is not) or one communication has been in flight that long.

The limit (:func:`limit_s`) is ``max(floor, factor x the slowest step so far)``:
``telemetry.watchdog_s`` (default 600 s) and ``telemetry.watchdog_factor`` (default 10). A
step's time includes its evaluation and checkpoint, and the longest gap without progress
inside a step, or the longest a communication stays in flight, is shorter than the step,
so once a step has been seen the limit is ``factor`` times anything that step contained. The
floor covers what comes before: the first step (warm-up; progress still comes with every
schedule action) and a first evaluation or save. Two phases do long work without progress
events and may come first long after the slowest step seen: ``checkpoint`` gets
``CHECKPOINT_FACTOR`` times the limit (parallel file systems are slow, not stuck) and
``eval`` one limit per held-out batch (``train.eval_batches``: each is a forward pass of a
global batch, less than a training step). ``factor = 0`` pins the limit to the floor (the
fault tests).

Work that runs beside the steps is watched by its age, not by progress:
:meth:`Watchdog.watch` takes a callable that returns ``(start, what)`` while such work runs
(the background write of an asynchronous checkpoint, ``Checkpointer.background_write``)
and None otherwise. The training loop keeps making progress while a background write
hangs, and waiting for it polls a collective that completes again and again, so progress
alone would feed the watchdog forever; instead a background write older than the
``checkpoint`` limit fires it, and the record names the write and its age.

If the limit passes, this rank writes to ``RUN_DIR/watchdog/``:

  ``rank<R>.json``   its flight recorder: step, phase, the last N operations of
                     ``topo.recorder.ring`` (op, axis, peer rank and grid coordinates,
                     bytes, state, age)
  ``rank<R>.stack``  the Python stack of every thread (``faulthandler``)

then waits ``grace`` seconds (a quarter of the limit, 2 to 120 s) for the other ranks'
records. The lowest rank that wrote one reads them all, prints ONE message naming the
suspects (ranks with no communication in flight while others wait: stalled in compute, or
wrote nothing at all: dead or stuck outside Python) and the operations the others are
waiting in, writes it to ``summary.txt``, and aborts the whole job (``comm.abort``, exit
code :data:`EXIT_CODE`). Every other rank aborts by itself after a second grace period, so
the job ends even when rank 0 is the dead one.

A rank whose main thread holds the interpreter lock inside a C call that never returns (an
HDF5 collective, whose h5py call keeps the lock, while a peer is stopped) starves this
thread. So each check also re-arms a backstop in C (``faulthandler.dump_traceback_later``,
:meth:`Watchdog.backstop_s`: 1.5 x the ``checkpoint`` limit + 5 s, longer than any firing of
the thread takes): when the thread has not run for that long, the rank prints
``Timeout (H:MM:SS)!`` and every thread's stack to stderr and exits 1, and the launcher ends
the job.

The thread uses no MPI except the final abort (the main thread may sit inside a
collective). It is a daemon that sleeps between checks (``poll``: a tenth of the floor, at
most 1 s) and only reads the ring and a few numbers, so ordinary runs do not pay for it;
:meth:`Watchdog.close` (``Telemetry.close`` at the end of the run) stops and joins it
within one poll. After an exception the job ends through ``python -m mpi4py`` (an abort);
if a rank's process ends without ``close``, the thread ends with it (a daemon).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from .. import comm
from ..topology import Coords

EXIT_CODE = 3
CHECKPOINT_FACTOR = 10


def limit_s(floor: float, factor: float, slowest_step_s: float, phase: str,
            eval_batches: int = 1) -> float:
    """Seconds without progress after which a rank in ``phase`` counts as stuck."""
    base = max(floor, factor * slowest_step_s)
    if phase == "checkpoint":
        return base * CHECKPOINT_FACTOR
    if phase == "eval":
        return base * max(1, eval_batches)
    return base


def peer_coords(topo, axis: str, peer: int) -> str:
    """Grid coordinates of rank ``peer`` of this rank's ``axis`` communicator."""
    if peer < 0:
        return f"all of {axis}"
    c = topo.coords
    ep, cp = topo.ep_size, getattr(topo, "cp_size", 1)
    change = {"pp": {"pp": peer}, "tp": {"tp": peer}, "ep": {"ep": peer}, "cp": {"cp": peer},
              "edp": {"dp_outer": peer}, "dp": {"dp_outer": peer // ep, "ep": peer % ep},
              "edpcp": {"dp_outer": peer // cp, "cp": peer % cp},
              "dpcp": {"dp_outer": peer // (ep * cp), "ep": peer // cp % ep, "cp": peer % cp}}
    if axis not in change:
        return f"rank {peer} of {axis}"
    return str(Coords(**{**c.__dict__, **change[axis]}))


class Watchdog:
    """Arms at the first :meth:`begin_step` and stays armed until :meth:`close` (the
    between-step reductions are watched too); :meth:`end_step` reports each step's seconds.
    ``timeout_s`` is the floor of the limit, ``factor`` the multiple of the slowest step.
    Not collective."""

    def __init__(self, timeout_s: float, topo, run_dir: Path, timers, factor: float = 0.0,
                 eval_batches: int = 1, ring_ops: int = 64):
        self.floor, self.factor, self.eval_batches = float(timeout_s), factor, eval_batches
        self.slowest = 0.0  # seconds of the slowest step so far
        self.topo, self.timers, self.ring_ops = topo, timers, ring_ops
        self.dir = Path(run_dir) / "watchdog"
        self.rank = topo.world.rank
        self.poll = min(1.0, max(0.05, self.floor / 10))
        self.step, self.t_step, self.armed = 0, 0.0, False
        self.last_progress = time.perf_counter()
        timers.listeners.append(lambda *_: self._progress())
        self._on_comm = lambda _rec: self._progress()
        self.topo.recorder.listeners.append(self._on_comm)
        self._watched: list = []  # callables: (start, what) of work beside the steps, or None
        self.stuck = ""  # what fired the watchdog when it is not the lack of progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        self.last_progress = time.perf_counter()

    def begin_step(self, step: int) -> None:
        self.step, self.t_step = step, time.perf_counter()
        self.last_progress, self.armed = self.t_step, True

    def end_step(self, step_s: float) -> None:
        """A step took ``step_s`` seconds (evaluation and checkpoint included)."""
        self.slowest = max(self.slowest, step_s)

    def watch(self, running) -> None:
        """Also watch work beside the steps: ``running()`` -> ``(perf_counter at its start,
        what it is)`` while it runs, else None; it fires after the ``checkpoint`` limit."""
        self._watched.append(running)

    def _overdue(self, now: float) -> tuple[str, float] | None:
        """(what, limit) of watched work older than the checkpoint limit, or None."""
        limit = limit_s(self.floor, self.factor, self.slowest, "checkpoint")
        for running in self._watched:
            got = running()
            if got is not None and now - got[0] > limit:
                return f"{got[1]} has run for {now - got[0]:.1f} s", limit
        return None

    def limit(self) -> float:
        """The limit now, for the phase this rank is in."""
        return limit_s(self.floor, self.factor, self.slowest, self.timers.current,
                       self.eval_batches)

    def backstop_s(self) -> float:
        """Seconds without a check after which the C backstop ends this rank."""
        worst = max(limit_s(self.floor, self.factor, self.slowest, "checkpoint"),
                    limit_s(self.floor, self.factor, self.slowest, "eval", self.eval_batches))
        return 1.5 * worst + 5.0

    def close(self) -> None:
        """Stop and join the thread (within one poll). Idempotent."""
        self.armed = False
        faulthandler.cancel_dump_traceback_later()
        if self._on_comm in self.topo.recorder.listeners:
            self.topo.recorder.listeners.remove(self._on_comm)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            if not self.armed:
                continue
            faulthandler.dump_traceback_later(self.backstop_s(), exit=True, file=2)
            now, limit = time.perf_counter(), self.limit()
            ops = list(self.topo.recorder.ring)[-self.ring_ops:]
            stuck = [r for r in ops if not r.completed and now - r.posted > limit]
            overdue = self._overdue(now)
            if overdue is not None and not stuck and now - self.last_progress <= limit:
                self.stuck, limit = overdue
            if now - self.last_progress > limit or stuck or overdue:
                self._fire(now, ops, limit)
                return

    def _record(self, now: float, ops) -> dict:
        rows = [{"op": r.op, "axis": r.axis, "peer": r.peer,
                 "peer_coords": peer_coords(self.topo, r.axis, r.peer), "bytes": r.nbytes,
                 "state": r.state, "age_s": round(now - r.posted, 3)} for r in ops]
        return {"rank": self.rank, "coords": str(self.topo.coords),
                "host": self.topo.hostname, "pid": os.getpid(), "step": self.step,
                "phase": self.timers.current, "step_age_s": round(now - self.t_step, 3),
                "idle_s": round(now - self.last_progress, 3),
                "timeout_s": round(self.limit(), 3), "stuck": self.stuck, "ops": rows}

    def _fire(self, now: float, ops, limit: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        grace = max(2.0, min(0.25 * limit, 120.0))
        rec = self._record(now, ops)
        tmp = self.dir / f".rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(self.dir / f"rank{self.rank}.json")  # readers see whole records only
        with open(self.dir / f"rank{self.rank}.stack", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        time.sleep(grace)
        records = read_records(self.dir, self.topo.world.size)
        if min(records) == self.rank:
            msg = summarise(records, self.topo.world.size, limit)
            (self.dir / "summary.txt").write_text(msg + "\n")
            print(msg, file=sys.stderr, flush=True)
        else:
            time.sleep(grace)  # the summariser aborts us; if it is dead, abort anyway
        comm.abort(EXIT_CODE)
        os._exit(EXIT_CODE)


def read_records(directory: Path, world_size: int) -> dict[int, dict]:
    out = {}
    for r in range(world_size):
        p = Path(directory) / f"rank{r}.json"
        if p.is_file():
            out[r] = json.loads(p.read_text())
    return out


def _waiting_in(rec: dict) -> str:
    flying = [o for o in rec["ops"] if o["state"] != "done"]
    if not flying:
        return ""
    o = flying[-1]
    return (f"{o['op']} on {o['axis']} with {o['peer_coords']} ({o['bytes']} B, "
            f"{o['age_s']:.1f} s)")


def summarise(records: dict[int, dict], world_size: int, timeout: float) -> str:
    """One message: suspects first (no record, or busy outside communication), then who
    waits in which operation."""
    lines, suspects = [], []
    for r in range(world_size):
        if r not in records:
            suspects.append(f"rank {r}: no flight record (dead, or stuck outside Python)")
            continue
        rec = records[r]
        who = f"rank {r} {rec['coords']} on {rec['host']}"
        waiting = _waiting_in(rec)
        if rec.get("stuck"):  # work beside the steps (a background checkpoint write)
            suspects.append(f"{who}: step {rec['step']}, {rec['stuck']}")
        elif waiting:
            lines.append(f"{who}: step {rec['step']}, waiting in {waiting}")
        else:
            suspects.append(f"{who}: step {rec['step']}, in '{rec['phase']}' without progress "
                            f"for {rec['idle_s']:.1f} s, no communication in flight")
    what = (f"no progress for {timeout:g} s" if not any(r.get("stuck") for r in records.values())
            else f"work beside the steps ran longer than its limit of {timeout:g} s")
    head = (f"hpctrain watchdog: {what}; aborting the job. "
            f"Stuck: {'; '.join(suspects) or 'every rank waits in communication'}.")
    return "\n".join([head, *("  " + x for x in lines),
                      "  flight records and stacks: RUN_DIR/watchdog/rank<R>.json, .stack"])
