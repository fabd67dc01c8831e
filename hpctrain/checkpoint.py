"""Collective checkpoints in parallel HDF5: one file per step, every tensor in its global shape.

File ``DIR/step_00000012.h5``::

    /model/<name>                   parameter, global (unsharded) shape
    /optim/<name>/<exp_avg|exp_avg_sq|master>
    attrs: step, optim_step, config (TOML), topology, versions, lineage, format

All ranks open the file with ``driver='mpio'`` and create every dataset collectively with
identical arguments (HDF5's rule); each rank then writes only the hyperslabs it owns: its tp
shard of a parameter, once per data-parallel replica group (dp rank 0 writes). Loading reads
the hyperslabs the *current* layout owns, so any layout restores any checkpoint.

Commit is atomic: the file is written as ``.step_N.h5.tmp``, closed collectively, fsynced,
renamed by rank 0, and only then is ``latest`` (a one-line text file, itself replaced
atomically) pointed at it. A crash mid-save leaves ``latest`` naming the previous file.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .config import CheckpointConfig
from .model.gpt import local_slice

FORMAT = "hpctrain-ckpt-1"
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def _np_dtype(t: torch.Tensor):
    # HDF5 has no bfloat16: store 16-bit floats widened to float32 (exact).
    return np.float32 if t.dtype in (torch.bfloat16, torch.float16) else \
        torch.empty((), dtype=t.dtype).numpy().dtype


def h5py_has_mpi() -> bool:
    import h5py

    return bool(h5py.get_config().mpi)


def latest(directory: str | Path) -> Path | None:
    """The committed checkpoint named by ``DIR/latest``, or None."""
    d = Path(directory)
    try:
        name = (d / LATEST).read_text().strip()
    except OSError:
        return None
    p = d / name
    return p if name and p.is_file() else None


class Checkpointer:
    """Save and load this rank's pieces. Every method is collective over the world."""

    def __init__(self, ccfg: CheckpointConfig, topo, directory: str | Path):
        self.cfg, self.topo = ccfg, topo
        self.dir = Path(directory)
        self.mpio = h5py_has_mpi()
        self.last_save = {}  # seconds, bytes of the last save (metrics)

    # -- what this rank owns -----------------------------------------------------------
    def _pieces(self, named_params, optimizer):
        """[(dataset path, local tensor, ParamMeta)] for everything this rank holds."""
        out = []
        for name, p in named_params:
            out.append((f"model/{name}", p.detach(), p.hp))
            for key, t in optimizer.state.get(name, {}).items():
                out.append((f"optim/{name}/{key}", t, p.hp))
        return out

    def _writes(self, meta) -> bool:
        """One writer per distinct piece: the first replica on every replicated axis."""
        topo = self.topo
        if meta.tp_dim is None and topo.tp_rank != 0:
            return False
        group = topo.edp_comm if meta.expert_dim is not None else topo.dp_comm
        return group.rank == 0

    def _slice(self, meta):
        t = self.topo
        return local_slice(meta, t.tp_size, t.tp_rank, t.ep_size, t.ep_rank)

    # -- save --------------------------------------------------------------------------
    def save(self, step: int, named_params, optimizer, attrs: dict) -> Path:
        import h5py

        t0 = time.perf_counter()
        world = self.topo.world
        if world.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        world.barrier()
        final = self.dir / step_name(step)
        tmp = self.dir / f".{final.name}.tmp"
        pieces = self._pieces(named_params, optimizer)
        # Every rank must create every dataset: gather all (path, shape, dtype) specs.
        specs = {(path, tuple(m.global_shape), np.dtype(_np_dtype(t)).str)
                 for path, t, m in pieces}
        all_specs = sorted(set().union(*world.allgather_obj(specs)))
        meta = world.bcast_obj(self._attrs(step, optimizer, attrs) if world.rank == 0
                               else None)  # identical attributes on every rank (HDF5 rule)
        if self.mpio:
            with h5py.File(tmp, "w", driver="mpio", comm=world.mpi) as f:
                self._create(f, all_specs, meta)
                nbytes = self._fill(f, pieces)
        else:
            nbytes = 0

            def turn(first: bool) -> None:
                nonlocal nbytes
                with h5py.File(tmp, "w" if first else "r+") as f:
                    if first:
                        self._create(f, all_specs, meta)
                    nbytes = self._fill(f, pieces)

            self._serially(turn)
        world.barrier()
        if world.rank == 0:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            self._point_latest(final.name)
            self._prune()
        world.barrier()
        total = world.allreduce(float(nbytes))
        self.last_save = {"save_s": time.perf_counter() - t0, "save_bytes": total}
        return final

    @staticmethod
    def _create(f, all_specs, meta: dict) -> None:
        for path, shape, dt in all_specs:
            f.create_dataset(path, shape=shape, dtype=np.dtype(dt))
        f.attrs.update(meta)

    def _fill(self, f, pieces) -> int:
        """Write the hyperslabs this rank owns; returns the bytes written."""
        nbytes = 0
        for path, t, m in pieces:
            if not self._writes(m):
                continue
            index, extent = self._slice(m)
            data = t[tuple(slice(0, n) for n in extent)].to("cpu")
            data = data.float() if data.dtype in (torch.bfloat16, torch.float16) else data
            f[path][index] = data.numpy()
            nbytes += data.numel() * data.element_size()
        return nbytes

    def _serially(self, fn) -> None:
        """Ranks take turns (serial fallback when h5py has no MPI)."""
        world = self.topo.world
        for r in range(world.size):
            if r == world.rank:
                fn(r == 0)
            world.barrier()

    def _attrs(self, step, optimizer, attrs) -> dict:
        out = {"format": FORMAT, "step": step, "optim_step": optimizer.step_count,
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "python": sys.version.split()[0], "torch": torch.__version__}
        out.update({k: v for k, v in attrs.items() if v is not None})
        # Plain str/int/float only (a str subclass such as torch's version becomes '<U').
        return {k: (str(v) if isinstance(v, str) else v) for k, v in out.items()}

    def _point_latest(self, name: str) -> None:
        tmp = self.dir / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.dir / LATEST)

    def _prune(self) -> None:
        if self.cfg.keep <= 0:
            return
        files = sorted(self.dir.glob("step_*.h5"))
        for old in files[:-self.cfg.keep]:
            old.unlink(missing_ok=True)

    # -- load --------------------------------------------------------------------------
    def load(self, path: str | Path, named_params, optimizer) -> dict:
        """Read this rank's hyperslabs of ``path`` into the parameters and optimizer state;
        returns the file's attributes. Collective over the world."""
        import h5py

        t0 = time.perf_counter()
        kw = {"driver": "mpio", "comm": self.topo.world.mpi} if self.mpio else {}
        with h5py.File(path, "r", **kw) as f:
            if f.attrs.get("format") != FORMAT:
                raise ValueError(f"{path} is not an hpctrain checkpoint")
            with torch.no_grad():
                for dpath, t, m in self._pieces(named_params, optimizer):
                    if dpath not in f:
                        raise KeyError(f"{path} has no dataset {dpath}")
                    if tuple(f[dpath].shape) != tuple(m.global_shape):
                        raise ValueError(f"{dpath}: checkpoint shape {f[dpath].shape} != "
                                         f"model shape {m.global_shape}")
                    index, extent = self._slice(m)
                    data = torch.from_numpy(np.ascontiguousarray(f[dpath][index]))
                    t[tuple(slice(0, n) for n in extent)] = data.to(t.dtype)
            attrs = dict(f.attrs)
        optimizer.step_count = int(attrs["optim_step"])
        self.last_load = {"load_s": time.perf_counter() - t0}
        return attrs
