"""Never hang silently (invariant 5): a watchdog thread per rank.

From the first step to the end of training, a daemon thread checks every ``poll`` seconds
whether this rank has made no progress for ``timeout_s`` (progress: a timer phase, a
schedule action or a communication completed; so a long step that keeps moving is fine, one
stuck phase is not) or one communication has been in flight that long. The ``checkpoint`` phase gets
``CHECKPOINT_FACTOR`` times the timeout (parallel file systems are slow, not stuck). If so,
this rank writes to ``RUN_DIR/watchdog/``:

  ``rank<R>.json``   its flight recorder: step, phase, the last N operations of
                     ``topo.recorder.ring`` (op, axis, peer rank and grid coordinates,
                     bytes, state, age)
  ``rank<R>.stack``  the Python stack of every thread (``faulthandler``)

then waits ``grace`` seconds for the other ranks' records. The lowest rank that wrote one
reads them all, prints ONE message naming the suspects (ranks with no communication in
flight while others wait: stalled in compute, or wrote nothing at all: dead or stuck outside
Python) and the operations the others are waiting in, writes it to ``summary.txt``, and
aborts the whole job (``comm.abort``, exit code :data:`EXIT_CODE`). Every other rank aborts
by itself after a second grace period, so the job ends even when rank 0 is the dead one.

The thread uses no MPI except the final abort (the main thread may sit inside a collective).
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


def peer_coords(topo, axis: str, peer: int) -> str:
    """Grid coordinates of rank ``peer`` of this rank's ``axis`` communicator."""
    if peer < 0:
        return f"all of {axis}"
    c = topo.coords
    ep = topo.ep_size
    change = {"pp": {"pp": peer}, "tp": {"tp": peer}, "ep": {"ep": peer},
              "edp": {"dp_outer": peer}, "dp": {"dp_outer": peer // ep, "ep": peer % ep}}
    if axis not in change:
        return f"rank {peer} of {axis}"
    return str(Coords(**{**c.__dict__, **change[axis]}))


class Watchdog:
    """Arms at the first :meth:`begin_step` and stays armed until :meth:`close` (the
    between-step reductions are watched too). Not collective."""

    def __init__(self, timeout_s: float, topo, run_dir: Path, timers, ring_ops: int = 64):
        self.timeout = float(timeout_s)
        self.topo, self.timers, self.ring_ops = topo, timers, ring_ops
        self.dir = Path(run_dir) / "watchdog"
        self.rank = topo.world.rank
        self.grace = max(2.0, 0.25 * self.timeout)
        self.step, self.t_step, self.armed = 0, 0.0, False
        self.last_progress = time.perf_counter()
        timers.listeners.append(lambda *_: self._progress())
        self._on_comm = lambda _rec: self._progress()
        self.topo.recorder.listeners.append(self._on_comm)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        self.last_progress = time.perf_counter()

    def begin_step(self, step: int) -> None:
        self.step, self.t_step = step, time.perf_counter()
        self.last_progress, self.armed = self.t_step, True

    def close(self) -> None:
        self.armed = False
        self.topo.recorder.listeners.remove(self._on_comm)
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        poll = min(1.0, max(0.05, self.timeout / 10))
        while not self._stop.wait(poll):
            if not self.armed:
                continue
            now = time.perf_counter()
            ops = list(self.topo.recorder.ring)[-self.ring_ops:]
            stuck = [r for r in ops if not r.completed and now - r.posted > self.timeout]
            limit = self.timeout * (CHECKPOINT_FACTOR if self.timers.current == "checkpoint"
                                    else 1)
            if now - self.last_progress > limit or stuck:
                self._fire(now, ops)
                return

    def _record(self, now: float, ops) -> dict:
        rows = [{"op": r.op, "axis": r.axis, "peer": r.peer,
                 "peer_coords": peer_coords(self.topo, r.axis, r.peer), "bytes": r.nbytes,
                 "state": r.state, "age_s": round(now - r.posted, 3)} for r in ops]
        return {"rank": self.rank, "coords": str(self.topo.coords),
                "host": self.topo.hostname, "pid": os.getpid(), "step": self.step,
                "phase": self.timers.current, "step_age_s": round(now - self.t_step, 3),
                "idle_s": round(now - self.last_progress, 3),
                "timeout_s": self.timeout, "ops": rows}

    def _fire(self, now: float, ops) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        rec = self._record(now, ops)
        tmp = self.dir / f".rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(self.dir / f"rank{self.rank}.json")  # readers see whole records only
        with open(self.dir / f"rank{self.rank}.stack", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        time.sleep(self.grace)
        records = read_records(self.dir, self.topo.world.size)
        if min(records) == self.rank:
            msg = summarise(records, self.topo.world.size, self.timeout)
            (self.dir / "summary.txt").write_text(msg + "\n")
            print(msg, file=sys.stderr, flush=True)
        else:
            time.sleep(self.grace)  # the summariser aborts us; if it is dead, abort anyway
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
        if waiting:
            lines.append(f"{who}: step {rec['step']}, waiting in {waiting}")
        else:
            suspects.append(f"{who}: step {rec['step']}, in '{rec['phase']}' without progress "
                            f"for {rec['idle_s']:.1f} s, no communication in flight")
    head = (f"hpctrain watchdog: no progress for {timeout:g} s; aborting the job. "
            f"Stuck: {'; '.join(suspects) or 'every rank waits in communication'}.")
    return "\n".join([head, *("  " + x for x in lines),
                      "  flight records and stacks: RUN_DIR/watchdog/rank<R>.json, .stack"])
