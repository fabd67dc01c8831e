"""Fault injection, for tests only: prove that every failure ends or recovers as designed.

Faults come from ``experimental.faults`` or the environment variable ``HPCTRAIN_FAULTS`` (both
are read; ``;``-separated), each ``KIND@RANK:STEP[:SECONDS]`` with RANK a world rank and
STEP the 1-based step as in ``metrics.jsonl``:

  ``kill@1:3``      rank 1 kills itself with SIGKILL during step 3 (a lost node)
  ``stall@1:3:600`` rank 1 sleeps 600 s (default 3600) inside 'compute' of step 3 (a hang)
  ``poison@0:2``    rank 0 writes NaN into one gradient of step 2
  ``slow@1:1:0.2``  rank 1 sleeps 0.2 s inside 'compute' of every step from step 1 (straggler)
  ``raise@1:2``     rank 1 raises RuntimeError in step 2 (an ordinary bug)

They act between the local backward and the gradient reduction, where the other ranks are
about to enter a collective. Not collective.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..parallel.grad_sync.interface import main_grad

KINDS = ("kill", "stall", "poison", "slow", "raise")
ENV = "HPCTRAIN_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0


def parse(text: str) -> list[Fault]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        try:
            kind, _, where = item.partition("@")
            fields = where.split(":")
            rank, step = int(fields[0]), int(fields[1])
            seconds = float(fields[2]) if len(fields) > 2 else 0.0
        except (ValueError, IndexError):
            raise ValueError(f"fault {item!r}: expected KIND@RANK:STEP[:SECONDS]") from None
        if kind not in KINDS:
            raise ValueError(f"fault {item!r}: kind must be one of {', '.join(KINDS)}")
        out.append(Fault(kind, rank, step, seconds))
    return out


class Faults:
    """The faults that concern this rank."""

    def __init__(self, spec: str, world_rank: int):
        text = ";".join(filter(None, (spec, os.environ.get(ENV, ""))))
        self.mine = [f for f in parse(text) if f.rank == world_rank]
        self.rank = world_rank

    def __bool__(self) -> bool:
        return bool(self.mine)

    def inject(self, step: int, named_params, timers) -> None:
        """Apply this rank's faults for 1-based ``step``."""
        for f in self.mine:
            if f.kind == "slow" and step >= f.step:
                with timers("compute"):
                    time.sleep(f.seconds)
            if f.step != step:
                continue
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
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
