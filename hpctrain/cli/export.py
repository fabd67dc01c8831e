"""``hpctrain export SOURCE --format safetensors|hf --out OUT``: a model's parameters (global
shapes, no optimizer state) from a checkpoint (verified first) or a Hugging Face directory
(read as ``hpctrain import`` reads it), in a format of ``interchange.formats``:
``safetensors`` (the default), ``hf`` or ``dcp``. One process, no MPI."""

from __future__ import annotations

import sys
from pathlib import Path

TRAILING = "out_pos"  # `export CKPT --format safetensors OUT`: OUT after the options
SOURCE_HELP = ("checkpoint file, a directory holding `latest`, or a Hugging Face "
               "Llama/Mixtral/Qwen-MoE directory (config.json + safetensors)")


def add_arguments(p) -> None:
    p.description = (
        "Export a model's parameters (no optimizer state). --format safetensors: one file in "
        "hpctrain's parameter names; an OUT without the .safetensors suffix gets it, and an "
        "existing directory (or OUT ending in /) gets model.safetensors; the resolved config "
        "is written beside it as <file>.config.toml. --format hf: a Hugging Face directory "
        "(config.json, model.safetensors or shards, the tokenizer) that transformers loads.")
    p.add_argument("checkpoint", metavar="SOURCE", help=SOURCE_HELP)
    p.add_argument("out_pos", nargs="?", metavar="OUT",
                   help="file or directory to write (default: --out)")
    p.add_argument("--out", help="file (safetensors) or directory (hf) to write (default: "
                   "OUT; one of them is needed)")
    from ..interchange import formats

    p.add_argument("--format", choices=formats.names("writes"), default="safetensors",
                   help="; ".join(f"{f.name}: {f.what}" for f in formats.FORMATS if f.writes)
                   + " (docs/interchange.md#formats)")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    p.add_argument("--max-shard-size", default="5GB",
                   help="hf: split the weights into shards of at most this size")
    p.add_argument("--tokenizer", help="hf: tokenizer.json (or its directory) to include; it "
                   "must have the sha256 the source recorded (default: the one the source's "
                   "lineage names)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="hf, dcp: tensor dtype; auto: the model's (dcp: float32 unless "
                        "the model is float64)")


def run(args) -> int:
    from ..data.tokenizer import TokenizerError
    from ..interchange import InterchangeError, formats

    out = args.out or args.out_pos
    if not out:
        print("hpctrain export: say where to write (--out OUT)", file=sys.stderr)
        return 2
    options = formats.Options(dtype=args.dtype, verify=not args.no_verify,
                              max_shard_size=args.max_shard_size, tokenizer=args.tokenizer)
    try:
        formats.get(args.format).writes(source(args.checkpoint), out, options, print)
    except (InterchangeError, TokenizerError, FileNotFoundError) as e:
        print(f"hpctrain export: {e}", file=sys.stderr)
        return 2
    return 0


def source(arg: str) -> Path:
    """A directory in a format a run reads directly (Hugging Face) as it is; else the
    checkpoint file ``arg`` names."""
    from ..interchange import formats
    from .inspect import resolve

    found = formats.detect(arg, "init_from")
    return Path(arg) if found is not None else resolve(arg)
