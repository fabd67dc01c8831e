"""Lineage: every input that shaped a run, written to the run directory and every checkpoint,
and the check that a resumed run still trains on the same data stream (content hash, data
seed, global batch size; ``data.allow_changed`` forces it, recorded as
``forced_data_change``).

``lineage.json`` in the run directory holds the dataset's lineage (content hash, tokenizer,
preparation parameters, source), the package versions, the git commit of the code, the layout
and the resolved config. Checkpoints carry the same as the attribute ``lineage`` (JSON).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path


class LineageError(RuntimeError):
    """Resuming is refused: it would silently change what the run trains on (data, seed,
    global batch), or the checkpoint cannot be continued (``store.CheckpointMismatch``). The
    CLI prints it once and exits 2 on every rank."""


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=5).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


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


def _changes(ckpt_attrs: dict, data_hash: str, seed, global_batch) -> list:
    """[(key, checkpoint's value, this run's, description)] for each input that differs."""
    out = []
    old = str(ckpt_attrs.get("data_hash", "") or "")
    if old and old != data_hash:
        out.append(("data_hash", old, data_hash, f"the checkpoint was trained on data "
                    f"{old[:16]} (content hash), this run's data is {data_hash[:16]}"))
    for key, new, name in (("data_seed", seed, "data seed (train.seed)"),
                           ("global_batch_size", global_batch, "train.global_batch_size")):
        saved = ckpt_attrs.get(key)
        if saved is not None and new is not None and int(saved) != int(new):
            out.append((key, int(saved), int(new),
                        f"the checkpoint's {name} is {int(saved)}, this run's is {int(new)}"))
    return out


def check_resume(ckpt_attrs: dict, data_hash: str, force: bool, info, seed=None,
                 global_batch=None) -> dict | None:
    """Refuse to resume when the data stream would change: the data's content hash, the data
    seed or the global batch size differ from the checkpoint's, unless forced; returns the
    recorded override when forced (``from``/``to``: the content hash; ``data_seed`` and
    ``global_batch_size``: ``{"from", "to"}``). Pure: every rank reaches the same verdict."""
    changes = _changes(ckpt_attrs, data_hash, seed, global_batch)
    if not changes:
        return None
    what = "; ".join(c[3] for c in changes)
    if not force:
        raise LineageError(f"refusing to resume: {what}. Set data.allow_changed=true to resume "
                           "with this change anyway (it is recorded in lineage.json).")
    info(f"warning: resuming on different data (forced): {what}")
    forced: dict = {}
    for key, old, new, _ in changes:
        forced.update({"from": old, "to": new} if key == "data_hash"
                      else {key: {"from": old, "to": new}})
    return forced


def start(run_dir: Path, cfg, topo, data_lineage: dict, resumed: dict | None, info) -> dict:
    """The run's lineage: checked against the checkpoint resumed from (refused on changed data,
    seed or global batch size unless ``data.allow_changed``), written to
    ``RUN_DIR/lineage.json`` by rank 0."""
    record = collect(data_lineage, topo.dims, topo.world_size)
    if resumed is not None:
        record["resumed_from"] = str(resumed.get("path"))
        forced = check_resume(resumed, str(data_lineage.get("content_hash", "")),
                              cfg.data.allow_changed, info, seed=cfg.train.seed,
                              global_batch=cfg.train.global_batch_size)
        if forced:
            record["forced_data_change"] = forced
    if topo.world.rank == 0:
        write(run_dir, record)
    return record
