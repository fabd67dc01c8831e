"""Writing one checkpoint file from a :class:`Snapshot`: the part of a save that runs either
in the training loop (``checkpoint.async = false``) or in the background (background.py).

A snapshot is what a rank must hand to the file: for every piece it writes, a 1-D buffer in
the global C order of its boxes (layout.py), the contiguous runs those bytes fill in the
global array and their CRC-32s (computed from memory, integrity.segments), and the file
attributes. :meth:`Writer.write` is collective over the writer's ``world`` group (the
training world, or its duplicate in the background):

1. one ``allgather``: every rank's dataset specs and CRC runs. From them every rank derives
   the sorted dataset list, each dataset's CRC-32 (runs joined in global order) and refuses
   (``IncompleteCheckpoint``, nothing created) unless the runs tile every dataset exactly;
   the first save also asks MPI which hints it applies (files.Opener.applied_hints);
2. ``.step_N.h5.tmp`` is created collectively (datasets allocated at once, without fill;
   checksums and attributes set once known), each rank writes its own bytes straight into
   the file at their dataset's offset (``pwrite``, the disk's writing started behind every
   8 MiB: :func:`write_runs`; HDF5's independent I/O took 1.6-2x as long for the same
   bytes), HDF5 collective I/O for datasets of at least ``collective_min_bytes``, closes and
   fsyncs its own writes (no collective ``MPI_File_sync`` before the close: the fsync after
   it covers them), then one barrier. Without MPI-IO rank 0 creates the file alone and the
   ranks write in place alike;
3. with ``checkpoint.verify_write`` the file is read back (datasets round-robin) and each
   CRC compared with the one computed from memory;
4. rank 0 appends the commit to the directory's log (trajectory.py), renames the file to
   ``step_N.h5``, points ``latest`` at it (one directory sync makes both renames durable; a
   crash before it leaves at worst a ``latest`` naming a missing file, which ``latest()``
   treats as absent), starts a thread that deletes the oldest files of the trajectory
   beyond ``checkpoint.keep``, and a barrier ends the save.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import faults
from . import integrity as cv
from .layout import Piece, byte_spans, dataset_offset, transfer, uncovered
from .trajectory import LATEST, trajectory
from .trajectory import append as log_event

CHUNK_BYTES = 8 << 20  # a pwrite's most; the disk starts writing behind each


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that fails verification (truncated, flipped bytes, not ours)."""


class IncompleteCheckpoint(RuntimeError):
    """The ranks did not write every element of a dataset: the file is not committed."""


def step_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def fault(rank: int, step: int) -> None:
    """Fault injection (hpctrain.faults ``ckpt_kill``): this rank dies (SIGKILL) in the
    middle of writing the checkpoint of ``step``."""
    if faults.find("ckpt_kill", rank, step):
        faults.die(f"rank {rank} killed while saving step {step}")


def failure(rank: int, step: int) -> None:
    """Fault injection (``ckpt_fail``): this rank's write of ``step`` fails (an OSError, as a
    full disk)."""
    if faults.find("ckpt_fail", rank, step):
        raise OSError(f"fault injection: rank {rank} cannot write step {step}")


@dataclass
class Snapshot:
    """One rank's share of checkpoint ``step``, independent of the live tensors when
    ``copy`` was asked (the next optimizer step cannot touch it)."""

    step: int
    pieces: dict  # path -> Piece (its boxes; the tensor is not read again)
    bufs: dict  # path -> 1-D numpy buffer (writers only)
    segs: dict  # path -> [(byte offset, nbytes, crc32)], filled by checksum_runs
    meta: dict  # file attributes (rank 0's are used)
    taken_s: float = 0.0
    written: list = field(default_factory=list)


def snapshot(step: int, pieces: dict[str, Piece], meta: dict, copy: bool) -> Snapshot:
    """Gather this rank's bytes (a private copy when ``copy``)."""
    t0 = time.perf_counter()
    bufs = {path: piece.gather(copy=copy) for path, piece in pieces.items()
            if piece.writes and piece.parts}
    sync_device(pieces)
    return Snapshot(step, pieces, bufs, {}, meta, time.perf_counter() - t0)


def checksum_runs(snap: Snapshot) -> None:
    """CRC-32 of every contiguous run of this rank's bytes (``snap.segs``). Runs in a thread
    of its own while the same bytes are written (zlib and HDF5 both release the GIL)."""
    snap.segs = {path: cv.segments(buf, snap.pieces[path].runs())
                 for path, buf in snap.bufs.items()}


def sync_device(pieces: dict[str, Piece]) -> None:
    """Device-to-host copies into pinned memory are asynchronous: wait for them once."""
    if any(p.tensor.is_cuda for p in pieces.values()):
        import torch

        torch.cuda.synchronize()


class Writer:
    """Writes snapshots into ``directory`` over ``world`` (collective). ``opener(path,
    mode)`` opens an h5py file over the same group (MPI-IO) or alone (serial).
    ``on_commit(step, path, seconds)`` is called on rank 0 right after each commit (from the
    writer thread for a background save)."""

    on_commit = None

    def __init__(self, world, directory: Path, opener, mpio: bool, cfg,
                 collective_min_bytes: int):
        self.world, self.dir, self.open, self.mpio, self.cfg = (world, directory, opener, mpio,
                                                                cfg)
        self.collective_min_bytes = collective_min_bytes
        self._pruner: threading.Thread | None = None

    def write(self, snap: Snapshot) -> dict:
        """Write, verify if asked, commit; returns the save's metrics."""
        t0 = time.perf_counter()
        world = self.world
        failure(world.rank, snap.step)
        if world.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".step_*.h5.tmp"):  # left by a crashed save
                stale.unlink(missing_ok=True)
        final = self.dir / step_name(snap.step)
        tmp = self.dir / f".{final.name}.tmp"
        specs, meta, total = self._plan(snap)
        crc = threading.Thread(target=checksum_runs, args=(snap,), name="hpctrain-crc")
        crc.start()
        try:
            sums = self._fill_file(tmp, specs, meta, snap, crc)
        except IncompleteCheckpoint:
            if world.rank == 0:
                tmp.unlink(missing_ok=True)
            raise
        finally:
            crc.join()
        copied = time.perf_counter()
        cv.fsync_file(tmp)  # every rank: its own writes on disk before rank 0 renames
        world.barrier()
        synced = time.perf_counter()
        t_write, t_sync = synced - t0, synced - copied
        if self.cfg.verify_write:
            self._verify(tmp, sums)
        slow = faults.find("ckpt_slow", self.world.rank, snap.step)
        if slow:
            time.sleep(slow.seconds)  # a long write, still in flight
        self._commit(tmp, final)
        dt = time.perf_counter() - t0
        if world.rank == 0 and self.on_commit is not None:
            self.on_commit(snap.step, final, dt + snap.taken_s)
        return {"ckpt_save_s": dt + snap.taken_s, "ckpt_save_bytes": total,
                "ckpt_write_s": t_write, "ckpt_fsync_s": t_sync,
                "ckpt_commit_s": dt - t_write,
                "ckpt_save_GBps": total / (dt + snap.taken_s) / 1e9, "path": str(final)}

    def _plan(self, snap: Snapshot):
        """(specs, attributes, bytes of all datasets), the same on every rank (one
        allgather). Refuses with
        IncompleteCheckpoint, before anything is created, unless the ranks together write
        every element of every dataset."""
        mine = ({(p.path, p.global_shape, p.dtype.str) for p in snap.pieces.values()},
                {path: b.size for path, b in snap.bufs.items()},
                snap.meta if self.world.rank == 0 else None)
        parts = self.world.allgather_obj(mine)
        specs = sorted(set().union(*(p[0] for p in parts)))
        paths = [s[0] for s in specs]
        if len(paths) != len(set(paths)):
            dup = sorted({p for p in paths if paths.count(p) > 1})
            raise ValueError(f"ranks disagree on the shape/dtype of {dup[:5]}")
        counts = [sum(p[1].get(path, 0) for p in parts) for path in paths]
        short = uncovered(specs, counts)
        if short:
            raise IncompleteCheckpoint(f"not committing {step_name(snap.step)}: the ranks "
                                       f"wrote {len(short)} dataset(s) incompletely: "
                                       + "; ".join(short[:5]))
        total = float(sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in specs))
        return specs, {**parts[0][2], "checksum": cv.CHECKSUM,
                       "mpi_hints_applied": self.open.applied_hints(self.dir)}, total

    def _sums(self, specs, snap: Snapshot, crc: threading.Thread) -> dict[str, int]:
        """Every dataset's CRC-32 from every rank's runs (one allgather), the same on every
        rank; IncompleteCheckpoint when runs overlap (then they leave a gap too)."""
        crc.join()
        segs: dict[str, list] = {path: [] for path, _, _ in specs}
        for part in self.world.allgather_obj(snap.segs):
            for path, s in part.items():
                segs[path] += s
        sums, bad = {}, []
        for path, shape, dt in specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            sums[path], why = cv.join_segments(segs[path], nbytes)
            if why:
                bad.append(f"{path} ({why})")
        if bad:
            raise IncompleteCheckpoint(f"not committing {step_name(snap.step)}: the ranks' "
                                       f"writes do not tile {len(bad)} dataset(s): "
                                       + "; ".join(bad[:5]))
        return sums

    def _fill_file(self, tmp: Path, specs, meta, snap: Snapshot, crc) -> dict[str, int]:
        """Create ``tmp``, write this rank's bytes and the checksums (once the CRC thread is
        done); returns them. With MPI-IO the file is created over the world (its hints,
        the striping, apply) and stays open while every rank writes; without, rank 0 creates
        it alone and the ranks write in turn only what cannot be written in place."""
        if self.mpio:
            with self.open(tmp, "w") as f:
                dsets = _create(f, specs, meta)
                offsets = {path: dataset_offset(d) for path, d in dsets.items()}
                self._fill(tmp, specs, snap, offsets, dsets)
                sums = self._sums(specs, snap, crc)
                for path, value in sums.items():  # collective: the same values everywhere
                    dsets[path].attrs["crc32"] = np.uint32(value)
            # no H5Fflush (a collective MPI_File_sync): every rank fsyncs after the close
            return sums
        offsets = None
        if self.world.rank == 0:
            with self.open(tmp, "w") as f:
                offsets = {path: dataset_offset(d) for path, d in _create(f, specs,
                                                                           meta).items()}
        offsets = self.world.bcast_obj(offsets)
        self._fill(tmp, specs, snap, offsets)
        rest = [s for s in specs if offsets[s[0]] is None and np.prod(s[1]) > 0]
        for r in range(self.world.size) if rest else ():  # ranks take turns
            if r == self.world.rank:
                with self.open(tmp, "r+") as f:
                    for path, _, _ in rest:
                        transfer(f[path], snap.pieces.get(path), write=True, collective=False,
                                 buf=snap.bufs.get(path))
            self.world.barrier()
        sums = self._sums(specs, snap, crc)
        if self.world.rank == 0:
            cv.stamp(tmp, sums)
        self.world.barrier()
        return sums

    def _fill(self, tmp: Path, specs, snap: Snapshot, offsets: dict, dsets=None) -> None:
        """Write the bytes this rank owns, every dataset in ``specs`` order (the same on all
        ranks, as collective I/O requires): datasets of at least ``collective_min_bytes``
        by HDF5 collective I/O, the others straight into the file at their offset
        (:func:`write_runs`: what independent HDF5 writes do, without their cost), or by
        HDF5 independently where there is no offset (only with ``dsets``: the file open)."""
        fd = os.open(tmp, os.O_WRONLY)
        flush = cv.Writeback(fd, CHUNK_BYTES)
        try:
            for i, (path, shape, dt) in enumerate(specs):
                if i == len(specs) // 2:
                    fault(self.world.rank, snap.step)
                big = int(np.prod(shape)) * np.dtype(dt).itemsize >= self.collective_min_bytes
                piece, buf = snap.pieces.get(path), snap.bufs.get(path)
                if dsets is not None and (big or offsets[path] is None):
                    transfer(dsets[path], piece, write=True, collective=big, buf=buf)
                elif offsets[path] is not None and buf is not None:
                    write_runs(fd, offsets[path], buf, piece.runs(), flush)
        finally:
            os.close(fd)

    def _verify(self, tmp: Path, sums: dict) -> None:
        """``checkpoint.verify_write``: read the file back, datasets round-robin, and compare
        each CRC with the one computed from memory. Collective."""
        world = self.world
        names = sorted(sums)[world.rank::world.size]
        found = cv.compute_checksums(tmp, names)
        bad = [n for n in names if found[n] != sums[n]]
        bad = [b for part in world.allgather_obj(bad) for b in part]
        if bad:
            if world.rank == 0:
                tmp.unlink(missing_ok=True)
            raise CorruptCheckpoint(f"not committing {tmp.name}: read back, {len(bad)} "
                                    f"dataset(s) differ from what was written: {bad[:5]}")

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rank 0 logs the commit (trajectory.py), renames the file, points ``latest`` at
        it (both made durable by one directory sync) and deletes the trajectory's old
        checkpoints in a thread of its own (off the
        critical path: deleting a large file takes as long as writing a small one); every
        rank returns once the file is committed. Collective."""
        if self.world.rank == 0:
            self.join_prune()
            log_event(self.dir, {"event": "commit", "file": final.name})
            os.replace(tmp, final)
            cv.write_durably(self.dir / LATEST, final.name + "\n")  # syncs the directory
            if self.cfg.keep > 0:
                self._pruner = threading.Thread(target=self._prune, args=(final.name,),
                                                name="hpctrain-prune", daemon=True)
                self._pruner.start()
        self.world.barrier()

    def join_prune(self) -> None:
        """Wait for the deletion of old checkpoints (before the next commit, at the end)."""
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def _prune(self, keep_name: str) -> None:
        """Delete all but the newest ``checkpoint.keep`` of the trajectory being trained
        (trajectory.py); files of no trajectory are never touched here."""
        for old in trajectory(self.dir)[:-self.cfg.keep]:
            if old != keep_name:
                (self.dir / old).unlink(missing_ok=True)


def write_runs(fd: int, base: int, buf: np.ndarray, runs, flush: cv.Writeback) -> None:
    """``pwrite`` the 1-D ``buf``, which holds ``runs`` ``[(flat element offset, elements)]``
    one after another (Piece.gather), into the dataset whose elements start at byte ``base``
    of the file ``fd``, at most ``CHUNK_BYTES`` a call, the disk's writing started behind
    them by ``flush`` (one for the whole file: many small datasets add up). ``buf`` has the
    dataset's dtype, so its bytes are the file's."""
    raw = memoryview(buf).cast("B")
    for pos, end, at in byte_spans(runs, buf.dtype.itemsize, base):
        while pos < end:  # pwrite may write less than asked
            done = os.pwrite(fd, raw[pos:min(end, pos + CHUNK_BYTES)], at)
            flush.wrote(at, done)
            pos, at = pos + done, at + done


def _create(f, specs, meta: dict) -> dict:
    """Every dataset, its space allocated at once so that its offset in the file is known
    (no fill: every element is written once, by its owner), then the file's attributes;
    identical arguments on every rank (HDF5's rule). {path: dataset} (looking a dataset up
    by path again costs more than writing a small one)."""
    from h5py import h5d, h5p

    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    dsets = {path: f.create_dataset(path, shape=shape, dtype=np.dtype(dt), dcpl=dcpl)
             for path, shape, dt in specs}
    f.attrs.update(meta)
    return dsets
