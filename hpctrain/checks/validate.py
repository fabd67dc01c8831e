"""Whether a config can run on a world size: every problem at once, before any collective.

``checks.rules.problems`` has the rules of the keys and the arithmetic (layout, model, batch);
the checks here need the pipeline split or the schedule's arithmetic
(``pipeline.schedules``), so they live above those modules, and are asked only of an
otherwise valid config. :func:`settled` is the config as a run records it. What the config
points at (the data file, the run directory) is checked by ``hpctrain train`` and ``hpctrain
plan`` after this (``hpctrain.checks.inputs``).
"""

from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError, microbatches
from ..model.families import resolved
from ..pipeline.schedules import check_fits, layer_ranges, virtual_stages
from .rules import problems


def validate(cfg: Config, world_size: int) -> None:
    """Raise :class:`ConfigError` listing every reason ``cfg`` cannot run on ``world_size``
    ranks. Not collective: every rank reaches the same verdict."""
    errors = problems(cfg, world_size)
    if not errors:
        s = cfg.schedule
        try:  # does the microbatch count fit the schedule; do the boundaries cut the layers
            check_fits(s.kind, cfg.topology.pp, microbatches(cfg), virtual_stages(cfg))
            if s.boundaries.strip():  # balanced splits always cut (n_layers >= stages)
                layer_ranges(cfg)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def settled(cfg: Config) -> Config:
    """``cfg`` as a run records it (config.toml, every checkpoint): its model family named
    (``model.family``; a config without one gets the family read from its flags, once)."""
    return dataclasses.replace(cfg, model=resolved(cfg.model))
