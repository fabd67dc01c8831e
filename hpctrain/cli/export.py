"""``hpctrain export CKPT --format safetensors OUT``: the model's parameters (global shapes,
no optimizer state) as one safetensors file, with the resolved config beside it as
``OUT.config.toml``. The checkpoint is verified first. One process, no MPI."""

from __future__ import annotations

from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint file, or a directory holding `latest`")
    p.add_argument("out", help="file to write")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum check")


def run(args) -> int:
    import h5py
    import torch
    from safetensors.torch import save_file

    from ..checkpoint import integrity as cv
    from .inspect import resolve

    path = resolve(args.checkpoint)
    if not args.no_verify:
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"source": str(path), **meta})
    Path(str(out) + ".config.toml").write_text(config)
    n = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {n:,} parameters (step {meta.get('step')}); "
          f"config in {out}.config.toml")
    return 0
