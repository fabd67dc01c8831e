"""Interleaved A/B measurement (issue 19, benchmark hygiene): the sides of a comparison run
in turns in the same processes (ABAB..., the order rotated each round), every ratio is taken
pair by pair, and its median, spread and the machine load before and after are reported;
a ratio whose spread covers 1.0 is "noise", never a win."""

from __future__ import annotations

import statistics

from .common import PAIRS as MIN_PAIRS  # noqa: F401 - one minimum for every benchmark
from .common import loadavg  # noqa: F401 - re-exported for the pipeline benchmark


def interleave(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Call every side once per round, the order rotated by one each round; ``sides``:
    name -> function returning one sample (seconds). Returns name -> samples, in rounds.
    Collective when the sides are."""
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(float(sides[n]()))
    return out


def paired(name: str, num: list[float], den: list[float], target: str) -> dict:
    """The ratio ``num[i] / den[i]`` of each round: median, spread (min, max), whether the
    spread covers 1.0 ("noise"), and whether the median meets ``target`` (e.g. ">= 1.15";
    never met when it is noise)."""
    ratios = [a / b for a, b in zip(num, den)]
    value = statistics.median(ratios)
    lo, hi = min(ratios), max(ratios)
    op, bound = target.split()
    ok = value >= float(bound) if op == ">=" else value <= float(bound)
    noise = lo <= 1.0 <= hi
    return {"name": name, "value": float(value), "target": target,
            "met": bool(ok and not noise), "spread": [float(lo), float(hi)],
            "pairs": len(ratios), "noise": bool(noise), "ratios": [float(x) for x in ratios]}
