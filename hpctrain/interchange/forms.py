"""How another trainer's checkpoint holds hpctrain's parameters: a form (torchtitan's in
``titan.py``, Megatron-Core's in ``megatron.py``) is a list of :class:`Unit`\\ s, each one
tensor of the checkpoint (or one layer of a stacked one, or its leading rows) and the hpctrain
parameters cut from it. ``trainers.py`` reads units one at a time; forms never read files.

A form has ``name``, ``units``, ``expected(shapes)`` ({checkpoint key: global shape} from
hpctrain's parameter shapes), ``padded`` ({key: (rows, rule)}: the first dimensions its
writer's padding rule allows a padded vocabulary), ``moment(key, which)`` (the key of the
optimizer's ``exp_avg``/``exp_avg_sq``/``step`` of a tensor), ``masters(key)`` (keys where a
float32 copy of it may be), ``ignored`` (keys that may be present unused), ``notes`` (what
the import should tell the user), ``steps(reader)`` and ``naming()`` (recorded in the
lineage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import InterchangeError


@dataclass(frozen=True)
class Unit:
    """Checkpoint tensor ``key`` (``[index]`` of its first dimension when not None; its first
    ``rows`` rows when not None) holds the hpctrain parameters ``parts``: (name, cut), where
    ``cut(array)`` takes the parameter out of what was read (None: all of it)."""

    key: str
    parts: tuple[tuple[str, Callable | None], ...]
    index: int | None = None
    rows: int | None = None

    def cut(self, a: np.ndarray):
        """(name, array) of each parameter in ``a``, what was read of the unit."""
        for name, fn in self.parts:
            yield name, np.ascontiguousarray(fn(a) if fn is not None else a)


def count(value, what: str) -> int:
    """``value`` (a step count a checkpoint records: a number, or a one-element tensor) as an
    int; anything but a whole number >= 0 is refused, naming ``what``."""
    if hasattr(value, "numel") and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**62 \
            or not float(value).is_integer():
        raise InterchangeError(f"{what} holds {str(value)[:80]!r}, not a step count (a whole "
                               f"number >= 0): the checkpoint is damaged; copy it again from "
                               f"its writer")
    return int(value)


def paired_steps(run, opt, where: str = "the checkpoint") -> tuple[int, int] | None:
    """(training step, optimizer step) from what a checkpoint records of each (checked by
    :func:`count`), either standing in for the other when alone; None when it records
    neither."""
    if run is None and opt is None:
        return None
    run = None if run is None else count(run, f"{where}'s training step")
    opt = None if opt is None else count(opt, f"{where}'s optimizer step")
    return (run if run is not None else opt), (opt if opt is not None else run)


def either(values) -> str:
    """``a``, ``a or b``, ``a, b or c``: the sizes a message offers."""
    words = [str(v) for v in values]
    return " or ".join(filter(None, (", ".join(words[:-1]), words[-1])))


def stacked(shape: tuple, layers: int | None) -> tuple:
    """``shape`` with a leading layer dimension when ``layers`` is not None."""
    return shape if layers is None else (layers, *shape)
