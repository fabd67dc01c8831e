"""Fault injection, for tests and fault campaigns only: one injector for every failure a run
must survive or end cleanly on. Faults come from the config (``experimental.faults``) and
the environment (``HPCTRAIN_FAULTS``, the same syntax; both are read, ``;``-separated), each
``KIND@RANK:STEP[:SECONDS]`` with RANK a world rank and STEP the 1-based step as in
``metrics.jsonl``; ``*`` for RANK or STEP matches any. Every kind names where it acts:

=================  ==========================================================================
``kill``           the rank kills itself (SIGKILL) in the step, before the gradient sync
``stall``          it sleeps SECONDS (default 3600) inside 'compute' (a hang)
``poison``         it writes NaN into one gradient
``slow``           it sleeps SECONDS inside 'compute' of every step from STEP on (straggler)
``raise``          it raises RuntimeError (an ordinary bug)
``ckpt_kill``      it dies halfway through writing the HDF5 checkpoint of step STEP
``ckpt_fail``      its write of that checkpoint fails (OSError, as a full disk)
``ckpt_slow``      that write sleeps SECONDS before its commit (still in flight)
``local_kill``     it dies halfway through a node-local shard of generation STEP
``local_fail``     its node-local write of generation STEP fails (OSError, a full disk)
``partner_kill``   it dies in the exchange of generation STEP with its partner node, its
                   sends and receives posted, none waited for
=================  ==========================================================================

With ``HPCTRAIN_FAULTS_ONCE=DIR`` each fault acts once across every process and relaunch
that shares DIR (the first to create its file there acts): a campaign arms a job's faults
up front and a relaunch that redoes the step does not die again. ``slow`` is exempt (it acts
on every step from STEP on).

The first five act in the training step (:mod:`hpctrain.telemetry.fault_injection`), the
others where the checkpoint code asks :func:`find`. Standard library only; not collective.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

KINDS = ("kill", "stall", "poison", "slow", "raise", "ckpt_kill", "ckpt_fail", "ckpt_slow",
         "local_kill", "local_fail", "partner_kill")
ENV = "HPCTRAIN_FAULTS"
ONCE = "HPCTRAIN_FAULTS_ONCE"
USAGE = ("KIND@RANK:STEP[:SECONDS] (RANK, STEP: a number or *), e.g. \"kill@1:3\" or "
         "\"ckpt_slow@*:*:1\"; kinds: " + ", ".join(KINDS))


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: any rank
    step: int | None  # None: any step
    seconds: float = 0.0
    index: int = field(default=0, compare=False)  # its place in the spec (its ONCE file)

    def hits(self, rank: int, step: int) -> bool:
        return self.rank in (None, rank) and self.step in (None, step)

    def claim(self) -> bool:
        """Whether this process may act on the fault now: always, or with
        ``HPCTRAIN_FAULTS_ONCE`` only the first time across every process sharing it."""
        folder = os.environ.get(ONCE, "")
        if not folder or self.kind == "slow":
            return True
        where = "*" if self.rank is None else self.rank
        name = f"{self.index}-{self.kind}@{where}:{'*' if self.step is None else self.step}"
        try:
            os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def _number(text: str) -> int | None:
    return None if text.strip() == "*" else int(text)


def parse(text: str) -> list[Fault]:
    """``;``-separated faults; ValueError naming the item and the syntax."""
    out = []
    for index, item in enumerate(filter(None, (s.strip() for s in text.split(";")))):
        kind, _, where = item.partition("@")
        try:
            fields = where.split(":")
            rank, step = _number(fields[0]), _number(fields[1])
            seconds = float(fields[2]) if len(fields) > 2 else 0.0
        except (ValueError, IndexError):
            raise ValueError(f"fault {item!r}: expected {USAGE}") from None
        if kind not in KINDS:
            raise ValueError(f"fault {item!r}: unknown kind {kind!r}; expected {USAGE}")
        out.append(Fault(kind, rank, step, seconds, index))
    return out


def spec(config_spec: str = "") -> str:
    """The faults asked for: the config's, then the environment's."""
    return ";".join(filter(None, (config_spec, os.environ.get(ENV, ""))))


_INSTALLED: list[list[Fault]] = []  # [faults of the run in this process], once installed


def install(config_spec: str) -> list[Fault]:
    """The run's faults (config and environment), for :func:`find`; returns them."""
    faults = parse(spec(config_spec))
    _INSTALLED[:] = [faults]
    return faults


def find(kind: str, rank: int, step: int) -> Fault | None:
    """The first installed fault of ``kind`` for ``rank`` at ``step`` (the environment's
    alone where no run installed any: a checkpoint written outside ``train``)."""
    faults = _INSTALLED[0] if _INSTALLED else parse(spec())
    return next((f for f in faults if f.kind == kind and f.hits(rank, step) and f.claim()),
                None)


def die(what: str) -> None:
    """SIGKILL this process after saying why on stderr (a lost node, not an exception)."""
    print(f"[hpctrain] fault injection: {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
