"""``hpctrain import DIR --out CKPT``: a Hugging Face Llama/Mixtral/Qwen directory (one or
several safetensors files), or with ``--config CONFIG`` a torch Distributed Checkpoint
(torchtitan's Llama 3, Megatron-Core's GPT), as an hpctrain checkpoint that any layout
resumes or starts from (``checkpoint.init_from``); the logic is ``interchange/hf_import.py`` and
``interchange/trainers.py``. One process, no MPI."""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("directory", help="Hugging Face model directory (config.json, safetensors), "
                   "DCP checkpoint directory (.metadata, *.distcp) or Megatron-LM save directory")
    p.add_argument("--out", required=True,
                   help="checkpoint file (*.h5) or directory (gets step_N.h5 + latest)")
    p.add_argument("--format", choices=["auto", "hf", "dcp"], default="auto",
                   help="hf: a Hugging Face directory; dcp: a torch Distributed Checkpoint "
                        "of torchtitan or Megatron-Core (needs --config); auto: by its files")
    p.add_argument("--config", help="dcp (required there; default: none): the hpctrain "
                   "config (TOML) of the checkpoint's model, the one you will train it with")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dcp: override a config key (repeatable)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="the model's dtype in hpctrain; auto: the HF config's (dcp: the "
                        "config's model.dtype)")


def run(args) -> int:
    from ..config import ConfigError, load
    from ..interchange.dcp import is_dcp_directory
    from ..interchange.hf_map import InterchangeError

    kind = args.format
    if kind == "auto":
        kind = "dcp" if is_dcp_directory(args.directory) else "hf"
    try:
        if kind == "hf":
            from ..interchange.hf_import import import_hf

            import_hf(args.directory, args.out, args.dtype)
            return 0
        if not args.config:
            raise InterchangeError(f"{args.directory} is a DCP checkpoint, which does not say "
                                   f"its model's shape: give --config CONFIG (an hpctrain "
                                   f"TOML whose [model] is the checkpoint's model)")
        from ..interchange.trainers import import_dcp

        dtype = [] if args.dtype == "auto" else [f"model.dtype={args.dtype}"]
        import_dcp(args.directory, args.out, load(args.config, [*args.set, *dtype]))
    except (InterchangeError, ConfigError) as e:
        print(f"hpctrain import: {e}", file=sys.stderr)
        return 2
    return 0
