"""``hpctrain export CKPT --format safetensors|hf --out OUT``: the model's parameters (global
shapes, no optimizer state). ``safetensors``: one file in hpctrain's names with the resolved
config beside it as ``OUT.config.toml``. ``hf``: a Hugging Face Llama/Mixtral directory
(``interchange/hf_export.py``). The checkpoint is verified first. One process, no MPI."""

from __future__ import annotations

import sys
from pathlib import Path

TRAILING = "out_pos"  # `export CKPT --format safetensors OUT`: OUT after the options


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint file, or a directory holding `latest`")
    p.add_argument("out_pos", nargs="?", metavar="OUT", help="file or directory to write")
    p.add_argument("--out", help="file (safetensors) or directory (hf) to write")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    p.add_argument("--max-shard-size", default="5GB",
                   help="hf: split the weights into shards of at most this size (5GB)")
    p.add_argument("--tokenizer", help="hf: tokenizer.json (or its directory) to include; it "
                   "must have the sha256 the checkpoint recorded")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="hf: weight dtype (auto: the model's)")


def run(args) -> int:
    out = args.out or args.out_pos
    if not out:
        print("hpctrain export: say where to write (--out OUT)", file=sys.stderr)
        return 2
    if args.format == "hf":
        from ..data.tokenizer import TokenizerError
        from ..interchange.hf_export import export_hf
        from ..interchange.hf_map import InterchangeError
        from .inspect import resolve

        try:
            export_hf(resolve(args.checkpoint), Path(out), args.dtype, args.max_shard_size,
                      args.tokenizer)
        except (InterchangeError, TokenizerError, FileNotFoundError) as e:
            print(f"hpctrain export: {e}", file=sys.stderr)
            return 2
        return 0
    return export_safetensors(args.checkpoint, Path(out), not args.no_verify)


def export_safetensors(checkpoint: str, out: Path, verify: bool) -> int:
    import h5py
    import torch

    from ..checkpoint import integrity as cv
    from ..interchange.hf_export import save_safetensors
    from .inspect import resolve

    path = resolve(checkpoint)
    if verify:
        problems = cv.verify(path)
        if problems:
            raise SystemExit(f"hpctrain export: {path} is damaged: {'; '.join(problems[:3])}")
    tensors, meta = {}, {}
    with h5py.File(path, "r") as f:
        for name in cv.dataset_names(f):
            if name.startswith("model/"):
                tensors[name[len("model/"):]] = torch.from_numpy(f[name][...])
        for key in ("format", "step", "data_hash", "git_commit", "versions", "topology"):
            if key in f.attrs:
                meta[key] = str(cv._plain(f.attrs[key]))
        config = str(cv._plain(f.attrs.get("config", "")))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out, {"source": str(path), **meta})
    Path(str(out) + ".config.toml").write_text(config)
    n = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {n:,} parameters (step {meta.get('step')}); "
          f"config in {out}.config.toml")
    return 0
