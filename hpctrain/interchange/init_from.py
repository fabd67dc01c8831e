"""``checkpoint.init_from = "DIR-or-CKPT"``: a new run's parameters from a Hugging Face
Llama/Mixtral/Qwen-MoE directory or an hpctrain checkpoint (file, or directory with ``latest``); the
optimizer starts fresh at step 0. A run that resumes (``checkpoint.resume``) ignores it.

:func:`problems` runs on every rank before any collective (the source exists, its model has
this run's architecture and shapes); :func:`load` has each rank read only its own slice of
every parameter (any layout), converted to the run's dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..checkpoint import integrity as cv
from ..config import Config, ModelConfig, from_dict
from . import InterchangeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

IGNORED = {"dtype", "device", "init_std", "recompute", "capacity_factor", "aux_loss_coef",
           "z_loss_coef"}  # how a model is trained, not which model it is


def source_kind(path: str) -> tuple[str, Path]:
    """(format name, path) of an ``init_from`` source: a format of the registry that
    ``init_from`` reads (``formats.FORMATS``: a Hugging Face directory), or ("ckpt", file)
    for an hpctrain checkpoint (a file, or a directory with ``latest``). A source in a format
    that needs an import first (a DCP directory) is refused, saying the command."""
    from . import formats

    p = Path(path)
    found = formats.detect(p)
    if found is not None and found.init_from:
        return found.name, p
    if found is not None:
        raise InterchangeError(
            f"checkpoint.init_from={path!r} is {found.what}, which a run does not read "
            f"directly: convert it first with `hpctrain import {path} --format {found.name}"
            f"{' --config CONFIG' if found.needs_config else ''} --out NEW_DIR` and give "
            f"NEW_DIR to checkpoint.init_from")
    if p.is_dir():
        from ..checkpoint import latest

        found_ckpt = latest(p)
        if found_ckpt is None:
            raise InterchangeError(f"checkpoint.init_from={path!r}: the directory is no format "
                                   f"hpctrain reads ({formats.described('init_from')}) and has "
                                   f"no `latest` (an hpctrain checkpoint directory)")
        return "ckpt", found_ckpt
    if p.is_file():
        return "ckpt", p
    raise InterchangeError(f"checkpoint.init_from={path!r}: nothing there")


def source_model(kind: str, path: Path) -> ModelConfig:
    """The model the source holds."""
    if kind == "hf":
        from .hf_import import HFReader

        return HFReader(path).model_config()
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != cv.FORMAT:
                raise InterchangeError(f"checkpoint.init_from: {path} is not an "
                                              f"hpctrain checkpoint")
            text = cv._plain(f.attrs.get("config", ""))
    except OSError as e:
        raise InterchangeError(f"checkpoint.init_from: {path} cannot be read "
                                      f"({e})") from None
    return from_dict(tomllib.loads(str(text))).model


def _named(m: ModelConfig) -> ModelConfig:
    """``m`` with its family named, where it has one (an unknown one stays as it is)."""
    from ..model.families import find, resolved

    return resolved(m) if find(m) is not None else m


# keys whose 0 means a default, and the property that says what they mean
MEANS = {"d_ff": "ffn_dim", "n_kv_heads": "kv_heads", "d_head": "head_dim",
         "expert_d_ff": "expert_dim", "shared_expert_d_ff": "shared_dim"}


def differences(mine: ModelConfig, theirs: ModelConfig) -> list[str]:
    """model.* keys (besides how it trains) where this run's model is another model (the
    family compared as each resolves: named, or read from the flags)."""
    out = []
    mine, theirs = _named(mine), _named(theirs)
    for key in sorted(set(vars(mine)) - IGNORED):
        a, b = getattr(mine, key), getattr(theirs, key, None)
        if key in MEANS:  # 0 means "the default": compare what it means
            a, b = getattr(mine, MEANS[key]), getattr(theirs, MEANS[key])
        if key in ("moe_every", "top_k") and not mine.num_experts:
            continue
        if a != b:
            out.append(f"model.{key} = {a!r}, the source has {b!r}")
    return out


def problems(cfg: Config) -> list[str]:
    """Why ``checkpoint.init_from`` cannot start this run (empty: it can). Reads only."""
    if not cfg.checkpoint.init_from:
        return []
    try:
        kind, path = source_kind(cfg.checkpoint.init_from)
        theirs = source_model(kind, path)
        diff = differences(cfg.model, theirs)
        if kind == "hf" and not diff:
            from .hf_import import HFReader, check_keys

            check_keys(HFReader(path), theirs)
    except InterchangeError as e:
        return [str(e)]
    if diff:
        return [f"checkpoint.init_from={cfg.checkpoint.init_from!r} holds another model: "
                + "; ".join(diff)]
    return tokenizer_problems(cfg, kind, path)


def data_file(cfg: Config) -> str:
    """The prepared file whose tokenizer this run's data has: ``data.path``, or a blend's
    first source (the blend checks make every source's the same)."""
    return cfg.data.sources[0].path if cfg.data.sources else cfg.data.path


def tokenizer_problems(cfg: Config, kind: str, path: Path) -> list[str]:
    """The source was trained with another tokenizer than this run's data uses (both known:
    ``data.tokenizer_match``); a source that records none is not checked."""
    from ..data import tokenizer_match as tm

    if kind == "hf":
        theirs, where = tm.of_hf_directory(path)
    else:
        import h5py

        with h5py.File(path, "r") as f:
            want, where = tm.recorded(str(cv._plain(f.attrs.get("lineage", ""))))
        theirs = set() if want is None else {want}
    mine, what = tm.of_data(data_file(cfg), cfg.data.tokenizer)
    if not theirs or not mine or theirs & mine:
        return []
    return [f"checkpoint.init_from={cfg.checkpoint.init_from!r} was trained with the tokenizer "
            f"of {tm.describe(tm.pick(theirs))} ({where}), but this run's data is tokenized with "
            f"{tm.describe(tm.pick(mine))} ({what}): train on data tokenized with the source's "
            f"tokenizer (hpctrain prepare FILES --tokenizer THAT.json, or data.tokenizer)"]


def load(cfg: Config, topo, params, state=()) -> str:
    """Copy this rank's slice of every parameter, and of the model's ``state`` (MoE selection
    biases) the source has, from ``checkpoint.init_from``; returns the source's path. A
    checkpoint is verified first (datasets dealt over the ranks)."""
    from ..checkpoint.checkpointer import CheckpointMismatch, CorruptCheckpoint

    kind, path = source_kind(cfg.checkpoint.init_from)
    world = topo.world
    if kind == "ckpt":
        bad = [p for part in world.allgather_obj(cv.verify(path, (world.rank, world.size)))
               for p in part]
        if bad:
            raise CorruptCheckpoint(f"checkpoint.init_from: {path} is damaged: "
                                    f"{'; '.join(bad[:3])}")
    if kind == "hf":  # each rank reads only its slices of the safetensors files
        from .hf_import import HFReader

        reader = HFReader(path)
        missing = _copy([*params, *state], topo,
                        lambda name, index: reader.slice_of(cfg.model, name, index))
    else:
        import h5py

        with h5py.File(path, "r") as f:
            missing = _copy([*params, *state], topo, lambda name, index:
                            f[f"model/{name}"][index] if f"model/{name}" in f else None)
    fresh = {name for name, _ in state}  # state the source lacks starts as a fresh run's
    missing = sorted({n for part in world.allgather_obj(missing) for n in part} - fresh)
    if missing:
        raise CheckpointMismatch(f"checkpoint.init_from={str(path)!r} lacks or misshapes "
                                 f"{len(missing)} parameter(s): {', '.join(missing[:5])}")
    return str(path)


def _copy(params, topo, read) -> list[str]:
    """Copy ``read(name, global index)`` into each local parameter; the names that failed.
    torch is imported here, not with the module: :func:`problems` runs before it."""
    import torch

    from ..model.stage import local_slice

    missing = []
    for name, p in params:
        index, extent = local_slice(p.hp, topo.tp_size, topo.tp_rank, topo.ep_size,
                                    topo.ep_rank)
        part = read(name, index)
        if part is None or tuple(part.shape) != tuple(extent):
            missing.append(name)
            continue
        with torch.no_grad():
            p.zero_()  # padding rows stay zero
            p[tuple(slice(0, n) for n in extent)] = torch.from_numpy(
                np.ascontiguousarray(part)).to(p.dtype)
    return missing
