"""``hpctrain inspect CKPT [--verify] [--json]``: tensors, shapes, dtypes and lineage of a
checkpoint (a file, or a checkpoint directory: its ``latest``), and how it was written (MPI-IO
hints requested and applied, alignment, I/O mode). ``--verify`` recomputes every
dataset's CRC-32 and exits 1 when any differs or the file is damaged. A data file written by
``hpctrain prepare``: tokens and documents per split and per input, the tokenizer and its
hash, every attribute (skipped files and records among them; ``--verify``: the content hash
recomputed). One process, no MPI."""

from __future__ import annotations

import json
from pathlib import Path

LINEAGE = ("format", "step", "optim_step", "data_next_step", "data_samples_seen", "epoch",
           "epoch_position", "blend_position", "data_hash", "topology", "world_size", "writer",
           "created", "git_commit", "versions", "checksum", "layout")


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint file, or a directory holding `latest`, or a "
                   "data file written by `hpctrain prepare`")
    p.add_argument("--verify", action="store_true",
                   help="recompute every dataset's checksum (exit 1 if any differs)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--config", action="store_true", help="print the resolved config (TOML)")


def resolve(path: str) -> Path:
    """A checkpoint file from a file or directory argument (clear error otherwise)."""
    from ..checkpoint import latest

    p = Path(path)
    if p.is_dir():
        found = latest(p)
        if found is None:
            raise SystemExit(f"hpctrain: {p} has no `latest` checkpoint")
        return found
    if not p.is_file():
        raise SystemExit(f"hpctrain: {p} does not exist")
    return p


def run(args) -> int:
    from ..checkpoint import integrity as cv

    path = resolve(args.checkpoint)
    data = data_file(path)
    if data is not None:
        return _data(data, args)
    problems = cv.verify(path) if args.verify else []
    try:
        info = cv.describe(path)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        info = {"path": str(path), "attrs": {}, "tensors": []}
        problems = problems or [f"{path}: cannot open ({e})"]
    if args.json:
        print(json.dumps({**info, "problems": problems if args.verify else None}, indent=1))
    elif info["tensors"]:
        _print(info, args.config)
    if problems and not args.json:
        print(f"{'VERIFY FAILED' if args.verify else 'UNREADABLE'}: {path}")
        for line in problems:
            print(f"  {line}")
    elif args.verify and not args.json:
        print(f"verify ok: {len(info['tensors'])} datasets match their checksums")
    return 1 if problems else 0


def lineage_lines(text: str) -> list[str]:
    """What the run was made from (the ``lineage`` attribute): its data, the checkpoint it
    resumed from, a forced data change and the learning-rate horizon."""
    try:
        lineage = json.loads(text) if text else {}
    except ValueError:
        return [f"lineage            unreadable ({str(text)[:60]}...)"]
    data = lineage.get("data", {})
    out = []
    if data:
        keys = ("source", "tokenizer", "tokenizer_hash", "content_hash", "seq_len")
        out.append("lineage data       " + ", ".join(f"{k}={data[k]}" for k in keys if k in data))
    for key, label in (("resumed_from", "resumed from"), ("forced_data_change", "forced data"),
                       ("decay_steps", "decay_steps")):
        if lineage.get(key) not in (None, ""):
            out.append(f"{label:18s} {lineage[key]}")
    return out


def io_settings(info: dict) -> list[str]:
    """How the file was written: the MPI-IO hints passed at open (verbatim), those MPI
    applied (``MPI_File_get_info``; absent in files written before it was recorded), the
    alignment asked for and how many large datasets start on it, independent or collective
    I/O."""
    try:
        layout = json.loads(info["attrs"].get("layout", "{}"))
    except ValueError:
        return []
    out = [f"mpi_hints          {json.dumps(layout.get('mpi_hints', {}), sort_keys=True)}"]
    applied = info["attrs"].get("mpi_hints_applied")
    if applied is not None:
        out.append(f"mpi_hints applied  {applied}")
    align, least = int(layout.get("alignment", 0) or 0), int(layout.get("align_min_bytes", 0))
    big = [t for t in info["tensors"] if t["nbytes"] >= least and t.get("offset") is not None]
    if align > 0:
        on = sum(1 for t in big if t["offset"] % align == 0)
        out.append(f"alignment          {align} bytes: {on} of {len(big)} datasets of >= "
                   f"{least} bytes start on it")
    else:
        out.append("alignment          none")
    if "collective_io" in layout:
        io = "collective MPI-IO" if layout["collective_io"] else "independent (own hyperslabs)"
        out.append(f"io                 {io}{', async' if layout.get('async') else ''}")
    return out


def _print(info: dict, with_config: bool) -> None:
    attrs = info["attrs"]
    print(f"checkpoint {info['path']}")
    for key in LINEAGE:
        if key in attrs:
            print(f"  {key:18s} {attrs[key]}")
    for line in lineage_lines(attrs.get("lineage", "")):
        print(f"  {line}")
    for line in io_settings(info):
        print(f"  {line}")
    total = 0
    print(f"  {'tensor':44s} {'shape':>16s} {'dtype':8s} crc32")
    for t in info["tensors"]:
        total += t["nbytes"]
        shape = "x".join(map(str, t["shape"]))
        print(f"  {t['name']:44s} {shape:>16s} {t['dtype']:8s} {t['crc32']}")
    print(f"  {len(info['tensors'])} datasets, about {total / 2**20:.2f} MiB")
    if with_config:
        print(attrs.get("config", ""))


def data_file(path: Path) -> dict | None:
    """A prepared data file's attributes and, per split, its tokens, documents and token
    dtype; None for anything else (a checkpoint has no ``train/tokens``)."""
    import h5py
    import numpy as np

    def plain(v):
        return v.decode() if isinstance(v, bytes) else v.item() if isinstance(v, np.generic) \
            else v.tolist() if isinstance(v, np.ndarray) else v

    try:
        with h5py.File(path, "r") as f:
            if not isinstance(f.get("train/tokens"), h5py.Dataset):
                return None
            splits = {s: {"tokens": int(f[f"{s}/tokens"].shape[0]),
                          "documents": (int(f[f"{s}/doc_starts"].shape[0])
                                        if f"{s}/doc_starts" in f else None),
                          "dtype": str(f[f"{s}/tokens"].dtype)}
                      for s in ("train", "val") if f"{s}/tokens" in f}
            attrs = {k: plain(v) for k, v in f.attrs.items()}
            chars = int(f["tokenizer_json"].shape[0]) if "tokenizer_json" in f else 0
    except OSError:
        return None
    return {"kind": "data", "path": str(path), "splits": splits, "attrs": attrs,
            "tokenizer_json_bytes": chars}


def per_source(text: str) -> list[str]:
    """The documents and tokens of each input, from a data file's ``source_counts``."""
    try:
        counts = json.loads(text)
    except ValueError:
        return [f"source_counts      unreadable ({text[:60]}...)"]
    return [f"source {c['source']}: train {c['train_documents']} documents "
            f"{c['train_tokens']} tokens, val {c['val_documents']} documents "
            f"{c['val_tokens']} tokens" for c in counts]


def _data(info: dict, args) -> int:
    """Print a data file (``--verify``: recompute its content hash); 1 when it differs."""
    problems = []
    if args.verify:
        import h5py

        from ..data.spill import tokens_hash

        with h5py.File(info["path"], "r") as f:
            digest = tokens_hash(f)
        if digest != info["attrs"].get("content_hash"):
            problems.append(f"content_hash {info['attrs'].get('content_hash')} recorded, the "
                            f"tokens hash to {digest}")
    if args.json:
        print(json.dumps({**info, "problems": problems if args.verify else None}, indent=1))
        return 1 if problems else 0
    attrs = dict(info["attrs"])
    print(f"data file {info['path']}")
    for split, s in info["splits"].items():
        docs = "unrecorded" if s["documents"] is None else s["documents"]
        print(f"  {split:18s} {s['tokens']} tokens, {docs} documents ({s['dtype']})")
    for key in ("tokenizer", "tokenizer_hash"):
        print(f"  {key:18s} {attrs.pop(key, 'unrecorded') or '(none)'}")
    print(f"  {'tokenizer_json':18s} {info['tokenizer_json_bytes'] or 'absent'} bytes")
    sources = str(attrs.pop("sources", "")).splitlines()
    for line in per_source(attrs.pop("source_counts", "[]")):
        print(f"  {line}")
    for key, value in sorted(attrs.items()):
        print(f"  {key:18s} {value}")
    if sources:
        more = f" (and {len(sources) - 1} more)" if len(sources) > 1 else ""
        print(f"  {'sources':18s} {sources[0]}{more}")
    for line in problems:
        print(f"VERIFY FAILED: {line}")
    if args.verify and not problems:
        print("verify ok: the tokens match content_hash")
    return 1 if problems else 0
