"""``hpctrain export CKPT --format hf --out DIR``: a checkpoint as a Hugging Face model
directory that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads.

DIR gets ``config.json`` (LlamaConfig or MixtralConfig fields), ``generation_config.json``,
the weights in HF key names (``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` when they exceed ``--max-shard-size``; Mixtral in the
published per-expert layout) and, when one is known, the tokenizer. One process, no MPI.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ..checkpoint import integrity as cv
from ..config import Config, dumps_toml, from_dict
from ..data import tokenizer, tokenizer_match
from . import hf_map
from .hf_map import INDEX

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


def read_checkpoint(path: Path, verify: bool = True) -> tuple[Config, dict, dict]:
    """(config, {name: numpy array} of model/, attributes) of a checkpoint (verified unless
    ``verify`` is false), or of a Hugging Face directory read as ``import`` reads it (its
    lineage and config as the attributes an imported checkpoint would have)."""
    import h5py

    from . import hf_import

    if hf_import.is_hf_directory(path):
        _, cfg, tensors, lineage = hf_import.read_hf(path)
        return cfg, tensors, {"config": dumps_toml(cfg), "lineage": json.dumps(lineage),
                              "step": 0}
    cfg, attrs = read_attributes(path, verify)
    with h5py.File(path, "r") as f:
        tensors = {n[len("model/"):]: f[n][...] for n in cv.dataset_names(f)
                   if n.startswith("model/")}
    return cfg, tensors, attrs


def read_attributes(path: Path, verify: bool = True) -> tuple[Config, dict]:
    """(config, attributes) of a checkpoint, verified first unless ``verify`` is false."""
    import h5py

    problems = cv.verify(path) if verify else []
    if problems:
        raise hf_map.InterchangeError(f"{path} is damaged: {'; '.join(problems[:3])}")
    with h5py.File(path, "r") as f:
        attrs = {k: cv._plain(v) for k, v in f.attrs.items()}
    return from_dict(tomllib.loads(str(attrs.get("config", "")))), attrs


def hf_tensors(cfg: Config, tensors: dict, dtype: str) -> dict:
    """{HF key: torch tensor} in HF's order, cast to ``dtype``."""
    import torch

    from ..model import DTYPES as TORCH

    out = {}
    for e in hf_map.entries(cfg.model):
        if e.name not in tensors:
            raise hf_map.InterchangeError(f"the checkpoint has no tensor model/{e.name} "
                                          f"(needed for {e.key})")
        t = torch.from_numpy(tensors[e.name])
        t = e.to_hf(t[e.expert] if e.expert is not None else t)
        wide = e.name.endswith(".route_bias") and dtype != "float64"  # HF keeps it float32
        t = t.to(torch.float32 if wide else TORCH[dtype]).contiguous()
        # a second HF key of one tensor (DeepSeek's copies) gets its own storage
        out[e.key] = t.clone() if any(v.data_ptr() == t.data_ptr() for v in out.values()) \
            else t
    unused = set(tensors) - {e.name for e in hf_map.entries(cfg.model)}
    if unused:
        raise hf_map.InterchangeError(f"checkpoint tensors with no HF counterpart: "
                                      f"{sorted(unused)[:5]}")
    return out


def shards(tensors: dict, limit: int) -> list[dict]:
    """Consecutive groups of tensors of at most ``limit`` bytes (a bigger tensor alone)."""
    groups: list[dict] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > limit:
            groups.append({})
            size = 0
        groups[-1][key] = t
        size += n
    return groups


def save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """``safetensors.torch.save_file``, then the mode any new file gets under the umask (the
    library writes a private temporary file, 0600, and renames it)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_weights(out: Path, tensors: dict, limit: int) -> list[str]:
    """model.safetensors, or numbered shards and their index; returns the file names."""
    groups = shards(tensors, limit)
    if len(groups) == 1:
        save_safetensors(tensors, out / "model.safetensors", {"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        save_safetensors(group, out / name, {"format": "pt"})
        weight_map.update({key: name for key in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX]


def export_hf(path: Path, out: Path, dtype: str = "auto", max_shard: str = "5GB",
              tokenizer_path: str | None = None, say=print) -> Path:
    """Write the HF directory ``out`` from checkpoint ``path``."""
    limit = parse_size(max_shard)
    cfg, arrays, attrs = read_checkpoint(path)
    hf_map.check_exportable(cfg.model)
    dtype = cfg.model.dtype if dtype == "auto" else dtype
    tensors = hf_tensors(cfg, arrays, dtype)
    source, why = tokenizer_match.resolve(str(attrs.get("lineage", "")),
                                          str(attrs.get("config", "")), tokenizer_path)
    out.mkdir(parents=True, exist_ok=True)
    max_len = max(cfg.train.seq_len, 2048)
    special, note = tokenizer.write(out, source, cfg.model.vocab_size, max_len)
    say(f"{note} ({why})")
    config = hf_map.hf_config(cfg.model, max_len, dtype, special)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_length": max_len,
           **{f"{k}_token_id": v for k, v in special.items()}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    files = write_weights(out, tensors, limit)
    n = sum(t.numel() for t in tensors.values())
    say(f"wrote {out}: {config['architectures'][0]}, {len(tensors)} tensors, {n:,} parameters "
        f"({dtype}, step {attrs.get('step')}) in {', '.join(files)}")
    return out
