"""Lineage: every input that shaped a run, written to the run directory and every checkpoint,
and the check that a resumed run still trains on the same data.

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
    """Resuming would silently change what the run trains on."""


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


def check_resume(ckpt_attrs: dict, data_hash: str, force: bool, info) -> dict | None:
    """Refuse to resume on a dataset whose content hash differs from the checkpoint's, unless
    forced; returns the recorded override when forced."""
    old = str(ckpt_attrs.get("data_hash", "") or "")
    if not old or old == data_hash:
        return None
    what = (f"the checkpoint was trained on data {old[:16]}..., this run's data is "
            f"{data_hash[:16]}...")
    if not force:
        raise LineageError(f"refusing to resume: {what} Set data.allow_changed=true to resume "
                           "on different data anyway (it is recorded in lineage.json).")
    info(f"warning: resuming on different data (forced): {what}")
    return {"from": old, "to": data_hash}


def start(run_dir: Path, cfg, topo, data_lineage: dict, resumed: dict | None, info) -> dict:
    """The run's lineage: checked against the checkpoint resumed from (refused on changed data
    unless ``data.allow_changed``), written to ``RUN_DIR/lineage.json`` by rank 0."""
    record = collect(data_lineage, topo.dims, topo.world_size)
    if resumed is not None:
        record["resumed_from"] = str(resumed.get("path"))
        forced = check_resume(resumed, str(data_lineage.get("content_hash", "")),
                              cfg.data.allow_changed, info)
        if forced:
            record["forced_data_change"] = forced
    if topo.world.rank == 0:
        write(run_dir, record)
    return record
