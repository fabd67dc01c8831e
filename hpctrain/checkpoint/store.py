"""Collective checkpoints in parallel HDF5: one file per step, every tensor in its global shape.

File ``DIR/step_00000012.h5`` (see docs/checkpoints.md)::

    /model/<name>                          parameter, global (unsharded) shape, attr crc32
    /optim/<name>/<exp_avg|exp_avg_sq|master>   same shape as the parameter, attr crc32
    /rng/torch                             (world_size, n) uint8: world rank r's torch RNG
    attrs: format, step, optim_step, data_next_step, data_samples_seen, data_hash, config
           (resolved TOML), topology, rng_layout, world_size, versions (JSON), git_commit,
           writer (mpio | serial), checksum (the scheme, see integrity.py), created

All ranks open the file with ``driver='mpio'`` (MPI-IO hints and alignment from
``[checkpoint]``) and create every dataset and attribute collectively with identical
arguments (HDF5's rule). Each rank then writes only the hyperslabs it owns (layout.py):
its tp/ep slice of a parameter, once per replica group (the first dp/edp rank and, for
tp-replicated tensors, tp rank 0); ZeRO flat shards are written by every dp rank. Datasets of
at least ``COLLECTIVE_MIN_BYTES`` use collective I/O (every rank takes part, possibly with
an empty selection), smaller ones independent I/O by their one writer. Loading reads the
hyperslabs the *current* layout owns, so any layout restores any checkpoint.

Commit is atomic and durable: the file is written as ``.step_N.h5.tmp``; the ranks check
that together they wrote every element of every dataset (datasets have no fill value), flush
it collectively (``H5Fflush``: ``MPI_File_sync``) and close it, and *every* rank fsyncs it
(each client's cached writes reach the disk); it is read back for per-dataset checksums,
stamped and fsynced by rank 0, renamed, the directory synced, and only then is ``latest`` (a
one-line text file, written to ``.latest.tmp``, fsynced, renamed, the directory synced)
pointed at it. A crash mid-save leaves ``latest`` naming the previous file; the stale
``.tmp`` is removed by the next save. ZeRO shards are written and read by their owners
directly (no rank gathers the optimizer state).

Without MPI in h5py (or with ``HPCTRAIN_CKPT_SERIAL=1``) ranks write the same format in
turn. ``HDF5_USE_FILE_LOCKING`` defaults to FALSE (see integrity.disable_file_locking).
Nothing in a checkpoint is executed on load: tensors, numbers and strings only (no pickle).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import comm
from ..config import CheckpointConfig
from . import integrity as cv
from .layout import Piece, misfits, pieces_of, transfer, uncovered, unknown_params
from .lineage import LineageError

FORMAT = cv.FORMAT
LATEST = "latest"
COLLECTIVE_MIN_BYTES = 64 << 10  # smaller datasets: independent I/O by their one writer
ALIGN_MIN_BYTES = 64 << 10  # objects at least this large start at a multiple of `alignment`
SERIAL_ENV = "HPCTRAIN_CKPT_SERIAL"
SCALER = "loss_scaler_"  # attribute prefix of the float16 loss scaler's state
KILL_RANK_ENV, KILL_STEP_ENV = "HPCTRAIN_FAULT_CKPT_KILL_RANK", "HPCTRAIN_FAULT_CKPT_KILL_STEP"


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that fails verification (truncated, flipped bytes, not ours)."""


class CheckpointMismatch(LineageError):
    """A sound checkpoint this run cannot continue (another model's shapes, a missing
    tensor). Raised alike on every rank; the CLI prints it once and exits 2."""


class IncompleteCheckpoint(RuntimeError):
    """The ranks did not write every element of a dataset: the file is not committed."""


def step_name(step: int) -> str:
    return f"step_{step:08d}.h5"


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
    """Checkpoints to try for ``checkpoint.resume = how``, best first: the one ``latest``
    names, then older committed files, newest first. An explicit file is the only one."""
    path = directory if how == "auto" else Path(how)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    out = [p for p in [latest(path)] if p is not None]
    out += [p for p in sorted(path.glob("step_*.h5"), reverse=True) if p not in out]
    return out


def _fault(rank: int, step: int) -> None:
    """Fault injection for tests: ``HPCTRAIN_FAULT_CKPT_KILL_RANK=r`` (and optionally
    ``..._KILL_STEP=s``) makes world rank r die (SIGKILL) in the middle of writing a checkpoint."""
    want = os.environ.get(KILL_RANK_ENV, "")
    when = os.environ.get(KILL_STEP_ENV, "")
    if want and int(want) == rank and (not when or int(when) == step):
        print(f"[hpctrain] fault injection: rank {rank} killed while saving step {step}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Checkpointer:
    """Save and restore this rank's pieces. Every method is collective over the world.
    ``collective_min_bytes``: datasets at least this large use collective I/O (comparisons
    raise it out of reach to measure independent I/O)."""

    def __init__(self, ccfg: CheckpointConfig, topo, directory: str | Path, warn=None,
                 collective_min_bytes: int = COLLECTIVE_MIN_BYTES):
        cv.disable_file_locking()
        self.cfg, self.topo = ccfg, topo
        self.collective_min_bytes = collective_min_bytes
        self.dir = Path(directory)
        self.warn = warn or (lambda msg: print(f"[hpctrain] warning: {msg}", file=sys.stderr))
        forced = os.environ.get(SERIAL_ENV, "") not in ("", "0")
        self.mpio = h5py_has_mpi() and not forced
        if not self.mpio and topo.world.rank == 0:
            why = f"{SERIAL_ENV} is set" if forced else "h5py was built without MPI"
            self.warn(f"checkpoints use the serial fallback ({why}): ranks write in turn")
        self.metrics: dict[str, float] = {}
        self._info = comm.mpi_info(ccfg.mpi_hints) if self.mpio else None  # MPI-IO hints

    def take_metrics(self) -> dict[str, float]:
        """Save/load seconds, bytes and GB/s since the last call (for metrics.jsonl)."""
        out, self.metrics = self.metrics, {}
        return out

    def _open(self, path, mode: str):
        import h5py

        kw = {}
        if self.cfg.alignment > 0:
            kw.update(alignment_threshold=ALIGN_MIN_BYTES, alignment_interval=self.cfg.alignment)
        if self.mpio:
            kw.update(driver="mpio", comm=self.topo.world.mpi, info=self._info)
        return h5py.File(path, mode, **kw)

    def _rng_piece(self, rows: int, state: torch.Tensor) -> Piece:
        r, n = self.topo.world.rank, state.numel()
        piece = Piece("rng/torch", (rows, n), np.dtype(np.uint8), state, True)
        piece.parts.append((lambda t: t, ((r, 0), (1, n))))
        return piece

    # -- save --------------------------------------------------------------------------
    def save(self, step: int, named_params, optimizer, attrs: dict) -> Path:
        """Write ``DIR/step_N.h5`` atomically and point ``latest`` at it."""
        t0 = time.perf_counter()
        world = self.topo.world
        if world.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".step_*.h5.tmp"):  # left by a crashed save
                stale.unlink(missing_ok=True)
        world.barrier()
        final = self.dir / step_name(step)
        tmp = self.dir / f".{final.name}.tmp"
        pieces = {p.path: p for p in pieces_of(named_params, optimizer, self.topo)}
        rng = self._rng_piece(world.size, torch.get_rng_state())
        pieces[rng.path] = rng
        specs = self._specs(pieces.values())
        meta = world.bcast_obj(self._attrs(step, optimizer, attrs) if world.rank == 0
                               else None)  # identical attributes on every rank (HDF5 rule)
        written = self._write(tmp, specs, pieces, meta, step)
        self._check_coverage(tmp, specs, written)
        cv.fsync_file(tmp)  # every rank: its own writes on disk before rank 0 renames
        world.barrier()
        t_write = time.perf_counter() - t0
        self._commit(tmp, final, [s[0] for s in specs])
        nbytes = sum(n * np.dtype(dt).itemsize for n, (_, _, dt) in zip(written, specs))
        total = world.allreduce(float(nbytes))
        dt = time.perf_counter() - t0
        self.metrics.update({"ckpt_save_s": dt, "ckpt_save_bytes": total,
                             "ckpt_write_s": t_write, "ckpt_save_GBps": total / dt / 1e9})
        return final

    def _specs(self, pieces) -> list[tuple[str, tuple, str]]:
        """(path, global shape, dtype) of every dataset any rank holds, sorted, identical on
        every rank; a tensor two ranks describe differently is an error."""
        mine = {(p.path, p.global_shape, p.dtype.str) for p in pieces}
        specs = sorted(set().union(*self.topo.world.allgather_obj(mine)))
        paths = [s[0] for s in specs]
        if len(paths) != len(set(paths)):
            dup = sorted({p for p in paths if paths.count(p) > 1})
            raise ValueError(f"ranks disagree on the shape/dtype of {dup[:5]}")
        return specs

    def _write(self, tmp: Path, specs, pieces: dict, meta: dict, step: int) -> list[int]:
        """Create and fill ``tmp`` (collectively, or ranks in turn); returns the elements this
        rank wrote per dataset of ``specs``."""
        if self.mpio:
            with self._open(tmp, "w") as f:
                self._create(f, specs, meta)
                written = self._fill(f, specs, pieces, step, collective=True)
                f.flush()  # collective H5Fflush: MPI_File_sync on every rank
        else:
            written = [0] * len(specs)

            def turn(first: bool) -> None:
                nonlocal written
                with self._open(tmp, "w" if first else "r+") as f:
                    if first:
                        self._create(f, specs, meta)
                    written = self._fill(f, specs, pieces, step, collective=False)
                    f.flush()

            self._serially(turn)
        self.topo.world.barrier()
        return written

    def _check_coverage(self, tmp: Path, specs, written: list[int]) -> None:
        """Datasets have no fill value, so an element nobody wrote holds whatever the disk
        held and a checksum would certify it: refuse to commit unless the ranks together wrote
        every element of every dataset (each element has one writer). Collective."""
        world = self.topo.world
        short = uncovered(specs, world.allreduce_array(np.asarray(written, dtype=np.int64)))
        if short:
            if world.rank == 0:
                tmp.unlink(missing_ok=True)
            raise IncompleteCheckpoint(f"not committing {tmp.name}: the ranks wrote "
                                       f"{len(short)} dataset(s) incompletely: "
                                       + "; ".join(short[:5]))

    @staticmethod
    def _create(f, specs, meta: dict) -> None:
        for path, shape, dt in specs:  # no fill: every element is written once, by its owner
            f.create_dataset(path, shape=shape, dtype=np.dtype(dt), fill_time="never")
        f.attrs.update(meta)

    def _fill(self, f, specs, pieces: dict, step: int, collective: bool) -> list[int]:
        """Write the hyperslabs this rank owns, every dataset in ``specs`` order (the same on
        all ranks, as collective I/O requires); returns the elements written per dataset."""
        written = []
        for i, (path, shape, dt) in enumerate(specs):
            if i == len(specs) // 2:
                _fault(self.topo.world.rank, step)
            piece = pieces.get(path)
            big = int(np.prod(shape)) * np.dtype(dt).itemsize >= self.collective_min_bytes
            transfer(f[path], piece, write=True, collective=collective and big)
            mine = piece is not None and piece.writes
            written.append(piece.nbytes // piece.dtype.itemsize if mine else 0)
        return written

    def _serially(self, fn) -> None:
        """Ranks take turns (serial fallback when h5py has no MPI)."""
        world = self.topo.world
        for r in range(world.size):
            if r == world.rank:
                fn(r == 0)
            world.barrier()

    def _commit(self, tmp: Path, final: Path, names: list[str]) -> None:
        """Checksums (read back round-robin); rank 0 stamps them, fsyncs, renames (directory
        synced), points ``latest`` at the file (durably) and prunes. Collective."""
        world = self.topo.world
        mine = cv.compute_checksums(tmp, names[world.rank::world.size])
        sums = {k: v for part in world.allgather_obj(mine) for k, v in part.items()}
        if world.rank == 0:
            cv.stamp(tmp, sums)
            cv.fsync_file(tmp)  # the stamped attributes
            cv.replace_durably(tmp, final)
            cv.write_durably(self.dir / LATEST, final.name + "\n")
            self._prune(keep_name=final.name)
        world.barrier()

    def _attrs(self, step, optimizer, attrs) -> dict:
        out = {"format": FORMAT, "step": step,
               "optim_step": int(getattr(optimizer, "step_count", step)),
               "data_next_step": step,
               "data_samples_seen": step * int(attrs.get("global_batch_size", 0)),
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "versions": cv.versions(),
               "git_commit": cv.git_commit(), "writer": "mpio" if self.mpio else "serial",
               "world_size": self.topo.world.size, "rng_layout": str(self.topo.dims),
               "layout": json.dumps({"dims(pp,dp_outer,ep,tp)": list(self.topo.dims),
                                     "mpi_hints": dict(self.cfg.mpi_hints),
                                     "alignment": self.cfg.alignment})}
        if getattr(optimizer, "scaler", None) is not None:  # {} unless float16
            out.update({SCALER + k: v for k, v in optimizer.scaler.state_dict().items()})
        out.update({k: v for k, v in attrs.items() if v is not None})
        # Plain str/int/float only (a str subclass such as torch's version becomes '<U').
        return {k: (str(v) if isinstance(v, str) else v) for k, v in out.items()}

    def _prune(self, keep_name: str) -> None:
        if self.cfg.keep <= 0:
            return
        files = sorted(self.dir.glob("step_*.h5"))
        for old in files[:-self.cfg.keep]:
            if old.name != keep_name:
                old.unlink(missing_ok=True)

    # -- restore -------------------------------------------------------------------------
    def check(self, path: Path) -> list[str]:
        """Verify ``path`` (format, every dataset's checksum), datasets dealt round-robin
        over the world; returns every rank's problems (the same list on all ranks)."""
        world = self.topo.world
        mine = cv.verify(path, (world.rank, world.size))
        return [p for part in world.allgather_obj(mine) for p in part]

    def restore(self, how: str, named_params, optimizer) -> dict | None:
        """``checkpoint.resume``: "" -> None; "auto" -> the newest sound checkpoint in the
        checkpoint directory, or None when there is none; a directory -> its newest sound
        one; a file -> that file. A damaged checkpoint is skipped with a warning for the
        previous one (not for an explicit file). Returns the loaded file's attributes plus
        ``path``. Collective over the world."""
        if not how:
            return None
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
                return {**self.load(path, named_params, optimizer), "path": str(path)}
            detail = "; ".join(problems[:3])
            if i + 1 == len(cands) or Path(how).is_file():
                raise CorruptCheckpoint(f"{path} is damaged ({detail}) and no earlier "
                                        f"checkpoint is left to fall back to")
            if world.rank == 0:
                self.warn(f"checkpoint {path} is damaged ({detail}); falling back to "
                          f"{cands[i + 1]}")
        return None  # unreachable

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
        paths = sorted(set().union(*world.allgather_obj(set(pieces))))
        with self._open(path, "r") as f:
            attrs = {k: cv._plain(v) for k, v in f.attrs.items()}
            if f.attrs.get("format") != FORMAT or "model" not in f:
                raise CheckpointMismatch(f"{path} is not an hpctrain checkpoint")
            errors = [e for part in world.allgather_obj(misfits(f, pieces)) for e in part]
            errors = errors or unknown_params(f, paths)  # the same on every rank
            if errors:  # before anything is read: every rank refuses alike
                raise CheckpointMismatch(
                    f"refusing to resume from {path}: it does not fit this model "
                    f"({len(errors)} problem(s): {'; '.join(errors[:3])})")
            nbytes = 0
            with torch.no_grad():
                for dpath in paths:
                    piece, dset = pieces.get(dpath), f[dpath]
                    big = dset.size * dset.dtype.itemsize >= self.collective_min_bytes
                    buf = transfer(dset, piece, write=False, collective=self.mpio and big)
                    if piece is not None:
                        piece.scatter(buf)
                        nbytes += buf.nbytes
                attrs["rng_restored"] = self._load_rng(f, attrs)
        if hasattr(optimizer, "step_count"):
            optimizer.step_count = int(attrs["optim_step"])
        if getattr(optimizer, "scaler", None) is not None:  # float16 dynamic loss scale
            optimizer.scaler.load_state_dict({k[len(SCALER):]: v for k, v in attrs.items()
                                              if k.startswith(SCALER)})
        total = world.allreduce(float(nbytes))
        dt = time.perf_counter() - t0
        self.metrics.update({"ckpt_load_s": dt, "ckpt_load_bytes": total,
                             "ckpt_load_GBps": total / dt / 1e9})
        return attrs

    def _load_rng(self, f, attrs) -> bool:
        """Per-rank RNG states are only meaningful on the layout that made them: restore
        them when the layout is the same, otherwise keep the seeded state. Collective."""
        same = (attrs.get("rng_layout") == str(self.topo.dims)
                and "rng/torch" in f and f["rng/torch"].shape[0] == self.topo.world.size)
        if not same:
            return False
        state = torch.get_rng_state().clone()
        piece = self._rng_piece(self.topo.world.size, state)
        piece.scatter(transfer(f["rng/torch"], piece, write=False, collective=False))
        torch.set_rng_state(state)
        return True
