"""``hpctrain import SOURCE --out CKPT``: a checkpoint in another format (a Hugging Face
directory; with ``--config CONFIG`` a torch Distributed Checkpoint of torchtitan or
Megatron-Core) as an hpctrain checkpoint that any layout resumes or starts from
(``checkpoint.init_from``). The formats, their detection and their importers are
``interchange/formats.py``'s registry. One process, no MPI."""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    from ..interchange import formats

    p.add_argument("directory", metavar="SOURCE", help="what to import: "
                   + formats.described() + "; a Megatron-LM save directory is DCP")
    p.add_argument("--out", required=True,
                   help="checkpoint file (*.h5) or directory (gets step_N.h5 + latest); "
                        "it must not exist, or be an empty directory")
    p.add_argument("--format", choices=["auto", *formats.names("reads")], default="auto",
                   help="auto: by its files; the formats: docs/interchange.md#formats")
    p.add_argument("--config", help="a format that does not describe its model (dcp: "
                   "required there; default: none): the hpctrain config (TOML) of the "
                   "checkpoint's model, the one you will train it with")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: override a config key (repeatable)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="the model's dtype in hpctrain; auto: the source's (with --config: "
                        "the config's model.dtype)")


def run(args) -> int:
    from pathlib import Path

    from ..config import ConfigError, load
    from ..interchange import InterchangeError, formats

    try:
        fmt = formats.source_format(args.directory) if args.format == "auto" else \
            formats.get(args.format)
        cfg = None
        if fmt.needs_config:
            if not args.config:
                raise InterchangeError(
                    f"{args.directory} is {fmt.what}, which does not say its model's shape: "
                    f"give --config CONFIG (an hpctrain TOML whose [model] is the "
                    f"checkpoint's model)")
            dtype = [] if args.dtype == "auto" else [f"model.dtype={args.dtype}"]
            cfg = load(args.config, [*args.set, *dtype])
        fmt.reads(Path(args.directory), Path(args.out),
                  formats.Options(cfg=cfg, dtype=args.dtype), print)
    except (InterchangeError, ConfigError) as e:
        print(f"hpctrain import: {e}", file=sys.stderr)
        return 2
    return 0
