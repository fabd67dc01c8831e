"""Lineage: every input that shaped a run, written to the run directory and every checkpoint;
the check that a resumed run still trains on the same sample stream (content hash, data
seed, global batch size, sequence length; ``data.allow_changed`` forces it, recorded as
``forced_data_change``); and the learning-rate decay horizon a resumed run carries over
(:func:`decay_horizon`).

``lineage.json`` in the run directory holds the dataset's lineage (content hash, tokenizer,
preparation parameters, source), the package versions, the git commit of the code, the layout
and the resolved config. Checkpoints carry the same as the attribute ``lineage`` (JSON).
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

from .integrity import git_commit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class LineageError(RuntimeError):
    """Resuming is refused: it would silently change what the run trains on (data, seed,
    global batch, sequence length), or the checkpoint cannot be continued
    (``store.CheckpointMismatch``). The CLI prints it once and exits 2 on every rank."""


def versions() -> dict:
    import h5py
    import mpi4py
    import numpy
    import torch
    from mpi4py import MPI

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "numpy": numpy.__version__, "mpi4py": mpi4py.__version__, "h5py": h5py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip("\x00 \n"),
            "platform": platform.platform()}


def collect(data_lineage: dict, topo_dims, world_size: int) -> dict:
    """Everything that names this run's inputs (identical on every rank but the clock)."""
    return {"data": {k: (v if isinstance(v, (int, float, str)) else str(v))
                     for k, v in data_lineage.items()},
            "versions": versions(), "commit": git_commit(),
            "layout": {"grid_pp_dp_ep_tp": list(topo_dims), "world_size": world_size}}


def write(run_dir: Path, lineage: dict) -> None:
    (Path(run_dir) / "lineage.json").write_text(json.dumps(lineage, indent=2) + "\n")


def recorded(ckpt_attrs: dict, attr: str, section: str, key: str):
    """The checkpoint's value of ``attr``; for a checkpoint that predates the attribute, its
    stored config's ``section.key``; None when neither says (or the checkpoint is at step 0:
    an import, whose config describes no training)."""
    if ckpt_attrs.get(attr) is not None:
        return ckpt_attrs[attr]
    if not int(ckpt_attrs.get("step", 0) or 0):
        return None
    try:
        return tomllib.loads(str(ckpt_attrs.get("config", "")))[section][key]
    except (tomllib.TOMLDecodeError, KeyError, TypeError):
        return None


# The inputs of the sample stream besides the data (data/sampler.py, Sampler): step s takes
# global samples s*G .. s*G+G-1 of the per-epoch orders drawn from the seed.
STREAM = (("data_seed", "seed", "data seed (train.seed)"),
          ("global_batch_size", "global_batch_size", "train.global_batch_size"),
          ("seq_len", "seq_len", "train.seq_len"))


def data_changes(ckpt_attrs: dict, data: dict) -> list[str]:
    """What differs between the data the checkpoint's lineage records and ``data`` (this
    run's data lineage): source, tokenizer, sequence length... besides the content hash."""
    try:
        old = json.loads(str(ckpt_attrs.get("lineage", "") or "{}")).get("data", {})
    except ValueError:
        old = {}
    return [f"{k} {old[k]!r} -> {data[k]!r}" for k in sorted(set(old) & set(data))
            if k != "content_hash" and str(old[k]) != str(data[k])]


def _changes(ckpt_attrs: dict, data_hash: str, run: dict, info, data=None) -> list:
    """[(key, checkpoint's value, this run's, description)] for each input that differs;
    an input the checkpoint does not record is named in one warning and not checked."""
    out, unknown = [], []
    old = str(ckpt_attrs.get("data_hash", "") or "")
    if old and old != data_hash:
        what = data_changes(ckpt_attrs, data or {})
        out.append(("data_hash", old, data_hash, "the checkpoint was trained on other data ("
                    + ("; ".join(what[:4]) + "; " if what else "the same description, other "
                       "contents: ") + f"content hash {old[:16]} -> {data_hash[:16]})"))
    for attr, key, name in STREAM:
        saved, new = recorded(ckpt_attrs, attr, "train", key), run.get(attr)
        if new is None:
            continue
        if saved is None:
            unknown.append(name)
        elif int(saved) != int(new):
            out.append((attr, int(saved), int(new), f"the checkpoint's {name} is "
                        f"{int(saved)}, this run's is {int(new)}"))
    if unknown and int(ckpt_attrs.get("step", 0) or 0):
        info(f"warning: the checkpoint records no {', '.join(unknown)}: not checked (this "
             f"run's value is used from here on)")
    return out


SHAPE_KEYS = ("family", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff",
              "vocab_size", "tie_embeddings", "num_experts", "moe_every", "expert_d_ff",
              "shared_experts", "shared_expert_d_ff", "qk_norm", "qkv_bias")


def model_changes(config_toml: str, model) -> list[str]:
    """The model keys that shape the parameters where the checkpoint's config (TOML) and
    ``model`` differ, as "model.KEY: A in the checkpoint, B in the config"; [] when either is
    missing or unreadable."""
    from ..config import ConfigError, from_dict
    from ..model.families import find, resolved

    try:
        saved = from_dict(tomllib.loads(config_toml)).model if config_toml else None
    except (ValueError, ConfigError):
        return []
    if saved is None or model is None:
        return []
    pair = [resolved(m) if find(m) is not None else m for m in (saved, model)]
    return [f"model.{k}: {getattr(pair[0], k)!r} in the checkpoint, {getattr(pair[1], k)!r} in "
            "the config" for k in SHAPE_KEYS if getattr(pair[0], k) != getattr(pair[1], k)]


def check_resume(ckpt_attrs: dict, data_hash: str, force: bool, info, seed=None,
                 global_batch=None, seq_len=None, data=None) -> dict | None:
    """Refuse to resume when the sample stream would change: the data's content hash, the
    data seed, the global batch size or the sequence length differ from the checkpoint's,
    unless forced; returns the recorded override when forced (``from``/``to``: the content
    hash; ``data_seed``, ``global_batch_size``, ``seq_len``: ``{"from", "to"}``). Pure:
    every rank reaches the same verdict."""
    run = {"data_seed": seed, "global_batch_size": global_batch, "seq_len": seq_len}
    changes = _changes(ckpt_attrs, data_hash, run, info, data)
    if not changes:
        return None
    what = "; ".join(c[3] for c in changes)
    if not force:
        keys = dict((attr, f"train.{key}") for attr, key, _ in STREAM)
        back = ", ".join(f"{keys[k]}={old}" for k, old, _, _ in changes if k in keys)
        raise LineageError(f"refusing to resume: {what}. Resume with the checkpoint's "
                           f"{'values (' + back + ')' if back else 'data'}, or set "
                           "data.allow_changed=true to resume with this change anyway (it is "
                           "recorded in lineage.json).")
    info(f"warning: resuming on different data (forced): {what}")
    forced: dict = {}
    for key, old, new, _ in changes:
        forced.update({"from": old, "to": new} if key == "data_hash"
                      else {key: {"from": old, "to": new}})
    return forced


def decay_horizon(cfg, resumed: dict | None, info) -> tuple[int, dict | None]:
    """The step at which the learning rate reaches ``min_lr`` (``optim.lr_at``'s horizon)
    and, when an explicit ``optim.decay_steps`` moves a resumed checkpoint's horizon,
    ``{"from", "to"}``. A fresh run (or an import at step 0): ``optim.decay_steps``, else
    ``train.steps``. A resumed run keeps its checkpoint's, whatever ``train.steps`` says, so
    the schedule goes on as the run that started the trajectory planned it (past the
    horizon: ``min_lr``)."""
    own = cfg.optim.decay_steps or cfg.train.steps
    if resumed is None or not int(resumed.get("step", 0) or 0):
        return own, None
    saved = recorded(resumed, "decay_steps", "optim", "decay_steps") or \
        recorded(resumed, "decay_steps", "train", "steps")
    if not saved:
        info(f"warning: the checkpoint records no decay horizon: the learning rate reaches "
             f"optim.min_lr after step {own} (this run's)")
        return own, None
    saved = int(saved)
    if cfg.optim.decay_steps and cfg.optim.decay_steps != saved:
        info(f"learning-rate schedule: optim.decay_steps={own} changes the checkpoint's decay "
             f"horizon ({saved} steps): the learning rate now reaches optim.min_lr after step "
             f"{own} (recorded in lineage.json)")
        return own, {"from": saved, "to": own}
    steps = cfg.train.steps
    after = (f"; steps {saved + 1}-{steps} run at min_lr" if steps > saved else
             f"; this run ends at step {steps}, before the decay does" if steps < saved else "")
    info(f"learning-rate schedule: reaches optim.min_lr={cfg.optim.min_lr:g} after step {saved},"
         f" the checkpoint's horizon (set optim.decay_steps to move it){after}")
    return saved, None


def start(run_dir: Path, cfg, topo, data_lineage: dict, resumed: dict | None, info) -> dict:
    """The run's lineage: checked against the checkpoint resumed from (refused on changed data,
    seed, global batch size or sequence length unless ``data.allow_changed``), with the
    learning-rate decay horizon (``decay_steps``, :func:`decay_horizon`), written to
    ``RUN_DIR/lineage.json`` by rank 0."""
    record = collect(data_lineage, topo.dims, topo.world_size)
    if resumed is not None:
        record["resumed_from"] = str(resumed.get("path"))
        t = cfg.train
        forced = check_resume(resumed, str(data_lineage.get("content_hash", "")),
                              cfg.data.allow_changed, info, seed=t.seed,
                              global_batch=t.global_batch_size, seq_len=t.seq_len,
                              data=data_lineage)
        if forced:
            record["forced_data_change"] = forced
    record["decay_steps"], moved = decay_horizon(cfg, resumed, info)
    if moved:
        record["decay_steps_changed"] = moved
    if topo.world.rank == 0:
        write(run_dir, record)
    return record
