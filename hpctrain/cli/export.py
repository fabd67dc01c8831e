"""``hpctrain export SOURCE --format safetensors|hf --out OUT``: a model's parameters (global
shapes, no optimizer state) from a checkpoint (verified first) or a Hugging Face directory
(read as ``hpctrain import`` reads it). ``safetensors`` (the default): one file in
hpctrain's parameter names, named ``*.safetensors`` (:func:`safetensors_path`), with the
resolved config beside it as ``<file>.config.toml``. ``hf``: a Hugging Face Llama/Mixtral/Qwen-MoE
directory (``interchange/hf_export.py``). One process, no MPI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRAILING = "out_pos"  # `export CKPT --format safetensors OUT`: OUT after the options
SUFFIX = ".safetensors"
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
    p.add_argument("--format", choices=["safetensors", "hf", "dcp"], default="safetensors",
                   help="safetensors: one file, hpctrain's names; hf: a Hugging Face "
                        "directory; dcp: a torch Distributed Checkpoint in torchtitan's "
                        "Llama 3 names, with the optimizer moments")
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
    from ..interchange.hf_map import InterchangeError

    out = args.out or args.out_pos
    if not out:
        print("hpctrain export: say where to write (--out OUT)", file=sys.stderr)
        return 2
    try:
        if args.format == "hf":
            from ..interchange.hf_export import export_hf

            export_hf(source(args.checkpoint), Path(out), args.dtype, args.max_shard_size,
                      args.tokenizer)
            return 0
        if args.format == "dcp":
            from ..interchange.trainers import export_dcp

            if Path(out).exists() and not Path(out).is_dir():
                raise InterchangeError(f"{out} is a file: --format dcp writes a directory; "
                                       f"give --out a new directory")
            export_dcp(source(args.checkpoint), Path(out), args.dtype, not args.no_verify)
            return 0
        return export_safetensors(source(args.checkpoint), safetensors_path(out),
                                  not args.no_verify)
    except (InterchangeError, TokenizerError, FileNotFoundError) as e:
        print(f"hpctrain export: {e}", file=sys.stderr)
        return 2


def source(arg: str) -> Path:
    """A Hugging Face directory as it is; else the checkpoint file ``arg`` names."""
    from ..interchange.hf_import import is_hf_directory
    from .inspect import resolve

    return Path(arg) if is_hf_directory(arg) else resolve(arg)


def safetensors_path(out: str) -> Path:
    """Where ``--format safetensors`` writes: OUT if it ends in .safetensors; in an existing
    directory (or OUT ending in a separator) ``model.safetensors``, the name a Hugging Face
    directory gives its weights; otherwise OUT with the suffix added."""
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        return Path(out) / f"model{SUFFIX}"
    return Path(out) if out.endswith(SUFFIX) else Path(out + SUFFIX)


def export_safetensors(path: Path, out: Path, verify: bool) -> int:
    """One safetensors file in hpctrain's names, the source's lineage as its metadata,
    written a block of one tensor at a time."""
    import functools

    import numpy as np
    import torch

    from ..checkpoint import integrity as cv
    from ..interchange.hf_export import open_source
    from ..interchange.safetensors_file import Planned, write_file

    with open_source(path, verify) as (_, source, attrs):
        tensors = [Planned(name, torch.from_numpy(np.empty(0, dt)).dtype, shape,
                           functools.partial(source.blocks, name))
                   for name, (shape, dt) in source.specs.items()]
        meta = {key: str(cv._plain(attrs[key])) for key in ("format", "step", "data_hash",
                                                             "git_commit", "versions",
                                                             "topology") if key in attrs}
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, tensors, {"source": str(path), **meta})
    Path(str(out) + ".config.toml").write_text(str(attrs.get("config", "")))
    n = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    print(f"wrote {out}: {len(tensors)} tensors, {n:,} parameters (step {meta.get('step')}); "
          f"config in {out}.config.toml")
    return 0
