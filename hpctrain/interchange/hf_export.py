"""``hpctrain export CKPT --format hf --out DIR``: a checkpoint as a Hugging Face model
directory that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads.

DIR gets ``config.json`` (LlamaConfig or MixtralConfig fields), ``generation_config.json``,
the weights in HF key names (``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` when they exceed ``--max-shard-size``; Mixtral in the
published per-expert layout) and, when one is known, the tokenizer. One process, no MPI.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from ..checkpoint import integrity as cv
from ..checkpoint.integrity import BLOCK_BYTES
from ..config import Config, dumps_toml, from_dict
from ..data import tokenizer, tokenizer_match
from . import hf_map
from .hf_map import INDEX
from .safetensors_file import Planned, write_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("float32", "bfloat16", "float16", "float64")
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``200MB``, ``64KiB``, ``1000`` -> bytes (HF's decimal units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in UNITS or float(m.group(1)) <= 0:
        raise hf_map.InterchangeError(f"--max-shard-size {text!r}: expected a positive size "
                                      f"such as 5GB, 200MB or 100000")
    return int(float(m.group(1)) * UNITS[m.group(2)])


class Arrays:
    """hpctrain parameters by name as arrays (the h5py datasets of an open checkpoint, or
    numpy arrays): ``specs`` {name: (global shape, numpy dtype)}; :meth:`blocks` reads one a
    block of rows at a time, :meth:`read` whole."""

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.specs = {name: (tuple(a.shape), np.dtype(a.dtype)) for name, a in arrays.items()}

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Parameter ``name``, or ``[index]`` of its first dimension (one expert)."""
        a = self.arrays[name]
        return np.asarray(a[()] if index is None else a[index])

    def blocks(self, name: str, index: int | None = None):
        """:meth:`read`'s array as blocks of rows of about ``BLOCK_BYTES``."""
        a = self.arrays[name]
        shape = a.shape if index is None else a.shape[1:]
        if not shape:
            yield self.read(name, index)
            return
        row = a.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        step = max(1, BLOCK_BYTES // max(1, row))
        for start in range(0, shape[0], step):
            rows = slice(start, start + step)
            yield np.asarray(a[rows] if index is None else a[index, rows])


class HFTensors:
    """A Hugging Face directory's parameters as ``import`` reads them, with the interface
    of :class:`Arrays` (a block is a whole parameter or expert)."""

    def __init__(self, reader, m):
        from .hf_import import global_specs, parameter_entries

        self.reader, self.entries = reader, parameter_entries(reader, m)
        self.specs = {name: (shape, np.dtype(dt))
                      for name, (shape, dt) in global_specs(reader, m).items()}

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        from .hf_import import global_tensor

        return global_tensor(self.reader, self.entries[name], index)

    def blocks(self, name: str, index: int | None = None):
        yield self.read(name, index)


@contextlib.contextmanager
def open_source(path: Path, verify: bool = True):
    """(config, parameters, attributes) of a checkpoint (verified unless ``verify`` is
    false; the parameters :class:`Arrays` of its model/ datasets, read while the file is
    open), or of a Hugging Face directory read as ``import`` reads it (:class:`HFTensors`;
    its lineage and config as the attributes an imported checkpoint would have)."""
    import h5py

    from . import hf_import

    if hf_import.is_hf_directory(path):
        reader, cfg, lineage = hf_import.open_hf(path)
        yield cfg, HFTensors(reader, cfg.model), {
            "config": dumps_toml(cfg), "lineage": json.dumps(lineage), "step": 0}
        return
    cfg, attrs = read_attributes(path, verify)
    with h5py.File(path, "r") as f:
        yield cfg, Arrays({n[len("model/"):]: f[n] for n in cv.dataset_names(f)
                           if n.startswith("model/")}), attrs


def read_attributes(path: Path, verify: bool = True) -> tuple[Config, dict]:
    """(config, attributes) of a checkpoint, verified first unless ``verify`` is false."""
    import h5py

    problems = cv.verify(path) if verify else []
    if problems:
        raise hf_map.InterchangeError(f"{path} is damaged: {'; '.join(problems[:3])}")
    with h5py.File(path, "r") as f:
        attrs = {k: cv._plain(v) for k, v in f.attrs.items()}
    return from_dict(tomllib.loads(str(attrs.get("config", "")))), attrs


def hf_planned(cfg: Config, source, dtype: str) -> list[Planned]:
    """Every HF tensor in HF's order as the writer streams it: key, ``dtype``, shape (from
    the source's metadata alone) and its blocks, read from ``source`` (:class:`Arrays`)
    when the writer reaches it."""
    import torch

    from ..model import DTYPES as TORCH

    out = []
    for e in hf_map.entries(cfg.model):
        if e.name not in source.specs:
            raise hf_map.InterchangeError(f"the checkpoint has no tensor model/{e.name} "
                                          f"(needed for {e.key})")
        shape = source.specs[e.name][0]
        wide = e.name.endswith(".route_bias") and dtype != "float64"  # HF keeps it float32
        dt = torch.float32 if wide else TORCH[dtype]
        out.append(Planned(e.key, dt, shape[1:] if e.expert is not None else shape,
                           functools.partial(_hf_blocks, source, e, dt)))
    unused = set(source.specs) - {e.name for e in hf_map.entries(cfg.model)}
    if unused:
        raise hf_map.InterchangeError(f"checkpoint tensors with no HF counterpart: "
                                      f"{sorted(unused)[:5]}")
    return out


def _hf_blocks(source, e: hf_map.Entry, dtype):
    """Entry ``e``'s tensor in HF's row order and ``dtype``, a block at a time (whole when
    its rows are reordered)."""
    import torch

    if e.rows is not None:
        yield e.to_hf(torch.from_numpy(source.read(e.name, e.expert))).to(dtype)
        return
    for block in source.blocks(e.name, e.expert):
        yield torch.from_numpy(block).to(dtype)


def shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive groups of keys of at most ``limit`` bytes together (``sizes``: bytes by
    key; a bigger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, n in sizes.items():
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups


def write_weights(out: Path, tensors: list[Planned], limit: int) -> list[str]:
    """model.safetensors, or numbered shards and their index, each file written as it
    fills (:func:`safetensors_file.write_file`); returns the file names."""
    groups = shards({t.key: t.nbytes for t in tensors}, limit)
    if len(groups) == 1:
        write_file(out / "model.safetensors", tensors, {"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    by_key = {t.key: t for t in tensors}
    weight_map = {}
    for name, group in zip(names, groups):
        write_file(out / name, [by_key[k] for k in group], {"format": "pt"})
        weight_map.update({key: name for key in group})
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX]


def export_hf(path: Path, out: Path, dtype: str = "auto", max_shard: str = "5GB",
              tokenizer_path: str | None = None, say=print) -> Path:
    """Write the HF directory ``out`` from checkpoint ``path``, one block of one tensor in
    memory at a time."""
    limit = parse_size(max_shard)
    with open_source(path) as (cfg, source, attrs):
        hf_map.check_exportable(cfg.model)
        dtype = cfg.model.dtype if dtype == "auto" else dtype
        tensors = hf_planned(cfg, source, dtype)
        source_tok, why = tokenizer_match.resolve(str(attrs.get("lineage", "")),
                                                  str(attrs.get("config", "")), tokenizer_path)
        out.mkdir(parents=True, exist_ok=True)
        max_len = max(cfg.train.seq_len, 2048)
        special, note = tokenizer.write(out, source_tok, cfg.model.vocab_size, max_len)
        say(f"{note} ({why})")
        config = hf_map.hf_config(cfg.model, max_len, dtype, special)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_length": max_len,
               **{f"{k}_token_id": v for k, v in special.items()}}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        files = write_weights(out, tensors, limit)
    n = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    say(f"wrote {out}: {config['architectures'][0]}, {len(tensors)} tensors, {n:,} parameters "
        f"({dtype}, step {attrs.get('step')}) in {', '.join(files)}")
    return out


SUFFIX = ".safetensors"


def safetensors_path(out: str) -> Path:
    """Where ``--format safetensors`` writes: OUT if it ends in .safetensors; in an existing
    directory (or OUT ending in a separator) ``model.safetensors``, the name a Hugging Face
    directory gives its weights; otherwise OUT with the suffix added."""
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        return Path(out) / f"model{SUFFIX}"
    return Path(out) if out.endswith(SUFFIX) else Path(out + SUFFIX)


def export_safetensors(path: Path, out: Path, verify: bool, say=print) -> Path:
    """One safetensors file in hpctrain's names, the source's lineage as its metadata,
    written a block of one tensor at a time."""
    import functools

    import numpy as np
    import torch

    from ..checkpoint import integrity as cv

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
    say(f"wrote {out}: {len(tensors)} tensors, {n:,} parameters (step {meta.get('step')}); "
          f"config in {out}.config.toml")
    return out
