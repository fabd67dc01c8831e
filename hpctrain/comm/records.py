"""What every communication did: the per-run record of operations.

A :class:`Recorder` belongs to one run (the :class:`hpctrain.topology.Topology` creates it
and every :class:`hpctrain.comm.Group` of that topology reports to it): per-axis exposed
seconds and bytes feed the step-time breakdown, the ring of the last operations is the
flight recorder the watchdog dumps when a rank is stuck, and listeners (the tracer, the
watchdog) see each completed operation. Two runs in one process keep separate records.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field


@dataclass
class OpRecord:
    op: str
    axis: str
    peer: int  # rank in the axis communicator; -1 for collectives
    nbytes: int
    posted: float
    completed: float = 0.0  # 0 while in flight

    @property
    def state(self) -> str:
        return "done" if self.completed else "in-flight"


@dataclass
class Recorder:
    """Per-process record of communication: exposed seconds and bytes per axis, and a ring
    of the last operations (the flight recorder)."""

    ring_size: int = 256
    exposed_s: collections.Counter = field(default_factory=collections.Counter)
    bytes: collections.Counter = field(default_factory=collections.Counter)
    calls: collections.Counter = field(default_factory=collections.Counter)
    ring: collections.deque = field(default_factory=collections.deque)
    listeners: list = field(default_factory=list)  # callables(record), e.g. the tracer

    def post(self, op: str, axis: str, peer: int, nbytes: int) -> OpRecord:
        rec = OpRecord(op, axis, peer, nbytes, time.perf_counter())
        self.ring.append(rec)
        while len(self.ring) > self.ring_size:
            self.ring.popleft()
        self.bytes[axis] += nbytes
        self.calls[axis] += 1
        return rec

    def complete(self, rec: OpRecord, waited_s: float) -> None:
        rec.completed = time.perf_counter()
        self.exposed_s[rec.axis] += waited_s
        for fn in self.listeners:
            fn(rec)

    def take(self) -> tuple[dict, dict]:
        """(exposed seconds, bytes) per axis since the last call; resets the counters."""
        out = dict(self.exposed_s), dict(self.bytes)
        self.exposed_s.clear()
        self.bytes.clear()
        self.calls.clear()
        return out

