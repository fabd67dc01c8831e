"""Collective checkpoints in parallel HDF5: one file per step, every tensor in its global shape.

File ``DIR/step_00000012.h5`` (see docs/checkpoints.md)::

    /model/<name>                          parameter, global (unsharded) shape, attr crc32
    /optim/<name>/<exp_avg|exp_avg_sq|master>   same shape as the parameter, attr crc32
    /rng/torch                             (world_size, n) uint8: world rank r's torch RNG
    attrs: format, step, optim_step, data_next_step, data_samples_seen, epoch and
           epoch_position (from the trainer: data/sampler.py), data_hash, config
           (resolved TOML), topology, rng_layout, world_size, versions (JSON), git_commit,
           writer (mpio | serial), checksum (the scheme, see integrity.py), created, layout
           (grid, MPI-IO hints, alignment)

:class:`Checkpointer` is the run's door to its checkpoints. A save takes a *snapshot* of this
rank's pieces (layout.py: the hyperslabs it owns; write.py: their bytes and CRC-32s, computed
from memory) and hands it to a :class:`~.write.Writer`: in the training loop, or with
``checkpoint.async`` in a background thread on a duplicated communicator (background.py),
at most one at a time. Every rank writes only its own hyperslabs (ZeRO shards included; no
rank gathers); the commit is atomic and durable (``.tmp``, fsync by every rank, rename,
``latest``). Loading reads the hyperslabs the *current* layout owns (read.py: ``preadv``,
strided ones from a memory map), so any layout restores any checkpoint; checksums are
verified first.

Without MPI in h5py (or with ``HPCTRAIN_CKPT_SERIAL=1``) rank 0 creates each file alone and
the ranks write their bytes in place as with MPI-IO (the same format).
``HDF5_USE_FILE_LOCKING`` defaults to FALSE (see integrity.disable_file_locking). Nothing
in a checkpoint is executed on load: tensors, numbers and strings only (no pickle).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import comm
from ..config import CheckpointConfig
from . import integrity as cv
from .background import CheckpointFailed, InFlight
from .files import Opener
from .layout import Piece, misfits, pieces_of, transfer, unknown_params
from .lineage import LineageError, model_changes
from .read import read_pieces
from .trajectory import aside_name, start, trajectory
from .write import (
    LATEST,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    Writer,
    snapshot,
    step_name,
)

__all__ = ["CheckpointFailed", "Checkpointer", "CorruptCheckpoint", "IncompleteCheckpoint",
           "latest", "step_name"]

FORMAT = cv.FORMAT
COLLECTIVE_MIN_BYTES = 64 << 10  # with collective_io: smaller datasets are independent I/O
NEVER = 1 << 62  # no dataset is that large: independent I/O only
ALIGN_MIN_BYTES = 64 << 10  # objects at least this large start at a multiple of `alignment`
SERIAL_ENV = "HPCTRAIN_CKPT_SERIAL"
SCALER = "loss_scaler_"  # attribute prefix of the float16 loss scaler's state


class CheckpointMismatch(LineageError):
    """A sound checkpoint this run cannot continue (another model's shapes, a missing
    tensor). Raised alike on every rank; the CLI prints it once and exits 2."""


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


def candidates(how: str, directory: Path) -> list[Path]:
    """Checkpoints to try for ``checkpoint.resume = how``, best first: the checkpoint
    directory's (``auto``) or the named directory's trajectory, newest first (never a file
    of an abandoned trajectory: trajectory.py). An explicit file is the only one."""
    path = directory if how == "auto" else Path(how)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return [path / name for name in reversed(trajectory(path))]


class Checkpointer:
    """Save and restore this rank's pieces. Every method is collective over the world.
    ``collective_min_bytes``: datasets at least this large use collective I/O; by default
    ``COLLECTIVE_MIN_BYTES`` with ``checkpoint.collective_io``, otherwise none (every rank
    writes and reads its own hyperslabs independently: no exchange, no collective call per
    dataset)."""

    def __init__(self, ccfg: CheckpointConfig, topo, directory: str | Path, warn=None,
                 collective_min_bytes: int | None = None, info=None, model=None):
        cv.disable_file_locking()
        self.model = model  # the run's [model], to name what a refused checkpoint differs in
        if collective_min_bytes is None:
            collective_min_bytes = COLLECTIVE_MIN_BYTES if ccfg.collective_io else NEVER
        self.cfg, self.topo = ccfg, topo
        self.collective_min_bytes = collective_min_bytes
        self.dir = Path(directory)
        self.warn = warn or (lambda msg: print(f"[hpctrain] warning: {msg}", file=sys.stderr))
        forced = os.environ.get(SERIAL_ENV, "") not in ("", "0")
        self.mpio = h5py_has_mpi() and not forced
        if not self.mpio and topo.world.rank == 0:
            why = f"{SERIAL_ENV} is set" if forced else "h5py was built without MPI"
            self.warn(f"checkpoints use the serial fallback ({why}): rank 0 creates each "
                      f"file alone, MPI-IO hints do not apply")
        self.metrics: dict[str, float] = {}
        # versions and the git commit, looked up once, at start-up rather than in the first
        # save's blocked time (git takes ~10 ms); rank 0 writes them
        self._env = ({"versions": cv.versions(), "git_commit": cv.git_commit()}
                     if topo.world.rank == 0 else {})
        self.writer = Writer(topo.world, self.dir, self._opener(topo.world), self.mpio, ccfg,
                             collective_min_bytes)
        # independent reads (the default): every rank opens the file alone (read.py says
        # why); collective ones: the world's MPI-IO opener, its property list shared
        self._reads_mpio = self.mpio and collective_min_bytes < NEVER
        self._reader = self.writer.open if self._reads_mpio or not self.mpio else Opener(
            topo.world, False, {}, 0, ALIGN_MIN_BYTES)
        self.background = self._background(collective_min_bytes)
        self.info = info  # rank 0's line for each commit (step, path, seconds)
        for w in (self.writer, self.background and self.background.writer):
            if w is not None:
                w.on_commit = self._committed

    def _background(self, collective_min_bytes: int) -> InFlight | None:
        """The background writer when ``checkpoint.async`` asks for it and MPI allows a
        second thread to call it; otherwise None (saves are synchronous, a warning says why).
        Collective."""
        if not self.cfg.async_:
            return None
        ok, level = comm.thread_multiple()
        if not ok:
            if self.topo.world.rank == 0:
                self.warn(f"checkpoint.async = true needs MPI_THREAD_MULTIPLE, this MPI "
                          f"provides {level}: saving synchronously")
            return None
        dup = self.topo.world.dup("ckpt-writer")  # its own Recorder: not the step's traffic
        writer = Writer(dup, self.dir, self._opener(dup), self.mpio, self.cfg,
                        collective_min_bytes)
        return InFlight(writer, self.topo.world)

    def _committed(self, step: int, path: Path, seconds: float) -> None:
        if self.info is not None:
            self.info(f"checkpoint of step {step} committed: {path} ({seconds:.2f} s)")

    def take_metrics(self) -> dict[str, float]:
        """Save/load seconds, bytes and GB/s since the last call (for metrics.jsonl)."""
        out, self.metrics = self.metrics, {}
        return out

    def _opener(self, group) -> Opener:
        return Opener(group, self.mpio, self.cfg.mpi_hints, self.cfg.alignment,
                      ALIGN_MIN_BYTES)

    def _rng_piece(self, rows: int, state: torch.Tensor) -> Piece:
        r, n = self.topo.world.rank, state.numel()
        piece = Piece("rng/torch", (rows, n), np.dtype(np.uint8), state, True)
        piece.parts.append((lambda t: t, ((r, 0), (1, n))))
        return piece

    # -- save --------------------------------------------------------------------------
    def pieces(self, named_params, optimizer) -> dict[str, Piece]:
        """Every piece of this rank a checkpoint holds (the local tier's too), RNG last."""
        pieces = {p.path: p for p in pieces_of(named_params, optimizer, self.topo)}
        rng = self._rng_piece(self.topo.world.size, torch.get_rng_state())
        return {**pieces, rng.path: rng}

    def save(self, step: int, named_params, optimizer, attrs: dict) -> Path:
        """Checkpoint ``step`` as ``DIR/step_N.h5`` (atomically, then ``latest``). With
        ``checkpoint.async`` only the snapshot happens here (after waiting for the save
        before, if it is still in flight) and the path returned is committed later."""
        t0 = time.perf_counter()
        if self.background is not None:
            self.wait()
        pieces = self.pieces(named_params, optimizer)
        meta = self.attributes(step, optimizer, attrs) if self.topo.world.rank == 0 else {}
        snap = snapshot(step, pieces, meta, copy=self.background is not None)
        if self.background is not None:
            self.background.start(snap)
            self.metrics["ckpt_blocked_s"] = time.perf_counter() - t0
        else:
            self.metrics.update(self.writer.write(snap))
            self.metrics.pop("path")
            self.metrics["ckpt_blocked_s"] = time.perf_counter() - t0
        return self.dir / step_name(step)

    def poll(self) -> None:
        """Once per step: the background save's end (its metrics join this step's record)
        or its failure (CheckpointFailed on every rank). Collective; free when synchronous."""
        if self.background is not None and self.background.busy:
            self._finished(self.background.poll(block=False))

    def wait(self) -> None:
        """Until no save is in flight (before the next save, a restore, the end of the run,
        a stop). Collective."""
        if self.background is not None and self.background.busy:
            t0 = time.perf_counter()
            self._finished(self.background.poll(block=True))
            self.metrics["ckpt_wait_s"] = time.perf_counter() - t0
        for w in (self.writer, self.background and self.background.writer):
            if w is not None:
                w.join_prune()  # old checkpoints deleted (rank 0)

    def background_write(self) -> tuple[float, str] | None:
        """(start, what) while this rank writes a checkpoint in the background, else None
        (for ``Watchdog.watch``). Not collective."""
        return self.background.running() if self.background is not None else None

    def _finished(self, metrics: dict | None) -> None:
        """A background save's figures join this step's record; a second one ending in the
        same step (the last step waits for its own save) is renamed ``ckpt_prev_*``."""
        if metrics:
            metrics.pop("path", None)
            if "ckpt_async_step" in self.metrics:
                for k in [k for k in metrics if k in self.metrics and k != "ckpt_blocked_s"]:
                    self.metrics["ckpt_prev_" + k[len("ckpt_"):]] = self.metrics.pop(k)
            self.metrics.update(metrics)

    def attributes(self, step, optimizer, attrs) -> dict:
        """The file attributes of a checkpoint of ``step`` (rank 0's are written)."""
        out = {"format": FORMAT, "step": step,
               "optim_step": int(getattr(optimizer, "step_count", step)),
               "data_next_step": step,
               "data_samples_seen": step * int(attrs.get("global_batch_size", 0)),
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **self._env,
               "writer": "mpio" if self.mpio else "serial",
               "world_size": self.topo.world.size, "rng_layout": str(self.topo.dims),
               "layout": json.dumps({"dims(pp,dp_outer,ep,cp,tp)": list(self.topo.dims),
                                     "mpi_hints": dict(self.cfg.mpi_hints),  # as requested
                                     "alignment": self.cfg.alignment,
                                     "align_min_bytes": ALIGN_MIN_BYTES,
                                     "collective_io": self.cfg.collective_io,
                                     "async": self.background is not None})}
        if getattr(optimizer, "scaler", None) is not None:  # {} unless float16
            out.update({SCALER + k: v for k, v in optimizer.scaler.state_dict().items()})
        out.update({k: v for k, v in attrs.items() if v is not None})
        # Plain str/int/float only (a str subclass such as torch's version becomes '<U').
        return {k: (str(v) if isinstance(v, str) else v) for k, v in out.items()}

    # -- restore -------------------------------------------------------------------------
    def check(self, path: Path) -> list[str]:
        """Verify ``path`` (format, every dataset's checksum), datasets dealt round-robin
        over the world; returns every rank's problems (the same list on all ranks)."""
        world = self.topo.world
        mine = cv.verify(path, (world.rank, world.size))
        return [p for part in world.allgather_obj(mine) for p in part]

    def restore(self, how: str, named_params, optimizer) -> dict | None:
        """``checkpoint.resume``: "never" or "" -> None; "auto" -> the newest sound
        checkpoint of the checkpoint directory's trajectory, or None when there is none; a
        directory -> its newest sound one; a file -> that file. A damaged checkpoint is
        skipped with a warning for the one before it on the trajectory (not for an explicit
        file). Returns the loaded file's attributes plus ``path``. Collective over the world."""
        if how in ("", "never"):
            return None
        self.wait()  # a rollback reads what the save in flight is committing
        world = self.topo.world
        cands = world.bcast_obj(candidates(how, self.dir) if world.rank == 0 else None)
        if not cands:
            if how == "auto":
                return None
            raise FileNotFoundError(f"checkpoint.resume={how!r}: no checkpoint there")
        for i, path in enumerate(cands):
            t0 = time.perf_counter()
            problems = self.check(path)
            if not problems:
                self.metrics["ckpt_verify_s"] = time.perf_counter() - t0
                try:
                    return {**self.load(path, named_params, optimizer), "path": str(path)}
                except CheckpointMismatch as e:
                    if how != "auto":
                        raise
                    raise CheckpointMismatch(
                        f"{e}. checkpoint.resume=auto continues the checkpoints of "
                        f"{self.dir}: to start a new run, use another --run-dir (or "
                        f"checkpoint.dir)") from None
            detail = "; ".join(problems[:3])
            if i + 1 == len(cands) or Path(how).is_file():
                raise CorruptCheckpoint(f"{path} is damaged ({detail}) and no earlier "
                                        f"checkpoint is left to fall back to")
            if world.rank == 0:
                self.warn(f"checkpoint {path} is damaged ({detail}); falling back to "
                          f"{cands[i + 1]}")
        return None  # unreachable

    def take_over(self, resumed: dict | None, step: int) -> tuple[str, str]:
        """The run starts at ``step`` (from ``resumed``, or fresh): before any save, rank 0
        moves every checkpoint of the directory that is not on the trajectory this run
        continues (the newer files of an abandoned one) into
        ``abandoned/<time>-from-step-<step>/`` and logs the start (trajectory.py): no save
        overwrites what another run wrote. Returns (the folder's name, for the metrics set
        aside with them; what was set aside, a sentence for the log, "" when nothing and on
        ranks but 0). Collective: a failure raises on every rank."""
        world, folder, said, failed = self.topo.world, aside_name(step), "", None
        if world.rank == 0:
            src = resumed.get("continues", resumed["path"]) if resumed else None
            src = Path(src) if src else None  # continues: the local tier's HDF5 ancestor
            own = src is not None and src.resolve().parent == self.dir.resolve()
            try:
                moved, where = start(self.dir, src.name if own else None, folder)
            except OSError as e:
                failed = f"cannot set aside the checkpoints of {self.dir}: {e}"
            else:
                said = (f"{len(moved)} checkpoint(s) not on the trajectory this run continues "
                        f"({', '.join(moved)}) set aside in {where}" if moved else "")
        failed = world.bcast_obj(failed)
        if failed:
            raise OSError(failed)
        return folder, said

    def roll_back(self, named_params, optimizer) -> str | None:
        """Restore the newest sound checkpoint of this run (the numeric guard's rollback);
        its path, or None when there is none. Collective over the world."""
        return (self.restore("auto", named_params, optimizer) or {}).get("path")

    def load(self, path: str | Path, named_params, optimizer) -> dict:
        """Read this rank's hyperslabs of ``path`` into the parameters and optimizer state
        (and the RNG when the layout is unchanged); returns the file's attributes."""
        t0 = time.perf_counter()
        world = self.topo.world
        pieces = {p.path: p for p in pieces_of(named_params, optimizer, self.topo)}
        with self._reader(path, "r") as f:
            attrs = {k: cv._plain(v) for k, v in f.attrs.items()}
            if f.attrs.get("format") != FORMAT or "model" not in f:
                raise CheckpointMismatch(f"{path} is not an hpctrain checkpoint")
            # one allgather: every rank's datasets and what does not fit on any rank
            parts = world.allgather_obj((set(pieces), misfits(f, pieces)))
            paths = sorted(set().union(*(p[0] for p in parts)))
            errors = [e for p in parts for e in p[1]] or unknown_params(f, paths)
            if errors:  # before anything is read: every rank refuses alike
                changed = model_changes(attrs.get("config", ""), self.model)
                raise CheckpointMismatch(
                    f"refusing to resume from {path}: " + (
                        f"another model ({'; '.join(changed)})" if changed else
                        f"it does not fit this model ({len(errors)} problem(s): "
                        f"{'; '.join(errors[:3])})"))
            nbytes = read_pieces(f, path, paths, pieces, self.collective_min_bytes,
                                 self._reads_mpio)
            attrs["rng_restored"] = self._load_rng(f, attrs)
        if hasattr(optimizer, "step_count"):
            optimizer.step_count = int(attrs["optim_step"])
        if getattr(optimizer, "scaler", None) is not None:  # float16 dynamic loss scale
            optimizer.scaler.load_state_dict({k[len(SCALER):]: v for k, v in attrs.items()
                                              if k.startswith(SCALER)})
        dt = time.perf_counter() - t0
        self.metrics.update({"ckpt_load_s": dt, "ckpt_load_bytes": float(nbytes),
                             "ckpt_load_GBps": nbytes / dt / 1e9})
        return attrs

    def _load_rng(self, f, attrs) -> bool:
        """Per-rank RNG states are only meaningful on the layout that made them: restore
        them when the layout is the same, otherwise keep the seeded state. Collective."""
        same = (_rng_dims(attrs.get("rng_layout")) == tuple(self.topo.dims)
                and "rng/torch" in f and f["rng/torch"].shape[0] == self.topo.world.size)
        if not same:
            return False
        state = torch.get_rng_state().clone()
        piece = self._rng_piece(self.topo.world.size, state)
        piece.scatter(transfer(f["rng/torch"], piece, write=False, collective=False))
        torch.set_rng_state(state)
        return True


def _rng_dims(text) -> tuple | None:
    """The grid dims a checkpoint's RNG states were saved on, as ``(pp, dp_outer, ep, cp,
    tp)``; a checkpoint from before context parallelism recorded ``(pp, dp_outer, ep, tp)``,
    the same rank order with cp = 1. None when absent or unreadable."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    try:
        dims = tuple(int(x) for x in str(text).strip("() ").split(",") if x.strip())
    except ValueError:
        return None
    return dims[:3] + (1,) + dims[3:] if len(dims) == 4 else dims
