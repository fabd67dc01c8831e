"""``hpctrain train CONFIG --run-dir DIR [--set section.key=value ...]``"""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("config", help="TOML preset, e.g. share/configs/demo.toml")
    p.add_argument("--run-dir", required=True, help="where metrics, logs and checkpoints go")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


def run(args) -> int:
    from .. import comm, slurm
    from ..config import ConfigError, load
    from ..validate import validate

    world = comm.world()
    if (wrong_launch := slurm.launch_error(world.size)) is not None:
        print(f"hpctrain train: {wrong_launch}", file=sys.stderr, flush=True)
        return 2
    try:
        cfg = load(args.config, args.overrides)
        validate(cfg, world.size)
    except (ConfigError, FileNotFoundError) as e:
        # Every rank reaches the same verdict before any collective: exit, no abort.
        if world.rank == 0:
            print(f"hpctrain train: {e}", file=sys.stderr)
        return 2
    from ..checkpoint.lineage import LineageError
    from ..train import train

    try:
        train(cfg, args.run_dir, world)
    except LineageError as e:  # raised alike on every rank (the checkpoint's attributes)
        if world.rank == 0:
            print(f"hpctrain train: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
