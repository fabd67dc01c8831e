"""The commit of a checkpoint without MPI (one rank, the serial writer): what is fsynced and
renamed in which order, a dataset region that nobody writes is refused, not certified, and
the bytes are written in place (or through HDF5 where there is no place).
(Every rank's fsync under MPI-IO: tests/mpi/test_checkpoint_commit_mpi.py.)"""

import os
from pathlib import Path

import pytest
import torch
from fakes import fake_topology

from hpctrain.checkpoint import checkpointer, write
from hpctrain.checkpoint import integrity as cv
from hpctrain.checkpoint.integrity import verify
from hpctrain.config import CheckpointConfig, OptimConfig
from hpctrain.model.stage import ParamMeta
from hpctrain.optim.adamw import AdamW


def _saver(tmp_path, monkeypatch):
    monkeypatch.setenv(checkpointer.SERIAL_ENV, "1")
    topo = fake_topology()
    named = []
    for name, shape in (("w", (6, 5)), ("b", (7,))):
        p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
        p.hp = ParamMeta(shape)
        named.append((name, p))
    opt = AdamW(named, OptimConfig())
    saver = checkpointer.Checkpointer(CheckpointConfig(), topo, tmp_path / "ckpt",
                                      warn=lambda m: None)
    return saver, named, opt


def test_commit_fsyncs_data_before_each_rename_and_the_directory_after(tmp_path, monkeypatch):
    saver, named, opt = _saver(tmp_path, monkeypatch)
    saver.save(1, named, opt, {})  # a first checkpoint: `latest` exists and gets replaced
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    saver.save(2, named, opt, {})
    d = saver.dir
    tmp, final = ".step_00000002.h5.tmp", "step_00000002.h5"
    assert events.count(("replace", tmp, final)) == 1, events
    assert events.count(("replace", ".latest.tmp", "latest")) == 1, events
    cut = events.index(("replace", tmp, final))
    point = events.index(("replace", ".latest.tmp", "latest"))
    before, between, after = events[:cut], events[cut + 1:point], events[point + 1:]
    # the file: every writer's fsync (the checksums were written with the data)
    assert before.count(("fsync", tmp)) >= 1, before
    assert ("fsync", ".latest.tmp") in between, "the pointer is renamed before it is synced"
    # one directory sync after both renames makes both durable; a crash before it can at
    # worst keep a `latest` that names a missing file, which latest() ignores
    assert ("fsync", d.name) in after, "the renames are not made durable"
    saver.wait()  # the old checkpoint is deleted in a thread, after the directory sync
    assert [p.name for p in sorted(d.glob("step_*.h5"))] == ["step_00000001.h5", final][
        -saver.cfg.keep:]
    assert (d / "latest").read_text().strip() == final and verify(d / final) == []


def test_a_region_nobody_writes_is_refused(tmp_path, monkeypatch):
    """Datasets are created without fill: an element no rank writes would hold whatever the
    disk held, and its checksum would certify it. The save refuses instead."""
    saver, named, opt = _saver(tmp_path, monkeypatch)
    first = saver.save(1, named, opt, {})
    real = checkpointer.pieces_of

    def missing_rows(named_params, optimizer, topo):
        out = real(named_params, optimizer, topo)
        for piece in out:
            if piece.path == "optim/w/exp_avg":  # keep the box but drop rows 2.. of it
                view, (start, count) = piece.parts[0]
                piece.parts[0] = (lambda t, v=view: v(t)[:2], (start, (2, *count[1:])))
        return out

    monkeypatch.setattr(checkpointer, "pieces_of", missing_rows)
    with pytest.raises(checkpointer.IncompleteCheckpoint, match=r"optim/w/exp_avg \(10 of 30"):
        saver.save(2, named, opt, {})
    d = saver.dir
    assert (d / "latest").read_text().strip() == first.name
    assert sorted(p.name for p in d.iterdir()) == ["commits.jsonl", "latest", first.name]  # no .tmp


def _reloaded(saver, path, named, opt):
    """Load ``path`` into zeroed copies of ``named`` and ``opt``; True when every parameter
    and moment comes back bit for bit."""
    fresh = [(n, torch.nn.Parameter(torch.zeros_like(p))) for n, p in named]
    for (_, p), (_, q) in zip(named, fresh):
        q.hp = p.hp
    opt2 = AdamW(fresh, OptimConfig())
    saver.load(path, fresh, opt2)
    same = all(torch.equal(p, q) for (_, p), (_, q) in zip(named, fresh))
    return same and all(torch.equal(opt.state[n][k], opt2.state[n][k])
                        for n in opt.state for k in opt.state[n])


def _trained(named, opt):
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step(1e-3)


def test_bytes_go_in_place_in_chunks_with_the_disk_started_behind(tmp_path, monkeypatch):
    """Every rank ``pwrite``s its bytes at the dataset's offset in the file: a write that
    takes fewer bytes than asked is continued, and the disk's writing is started behind
    every chunk; the file is a plain HDF5 file that verifies and loads bit for bit."""
    saver, named, opt = _saver(tmp_path, monkeypatch)
    _trained(named, opt)
    monkeypatch.setattr(write, "CHUNK_BYTES", 64)
    real_pwrite, ranges = os.pwrite, []
    monkeypatch.setattr(write.os, "pwrite", lambda fd, b, at: real_pwrite(fd, b[:40], at))
    monkeypatch.setattr(cv, "_sync_file_range", lambda fd, at, n: ranges.append((at, n)))
    path = saver.save(1, named, opt, {})
    m = saver.take_metrics()  # where the save's time went
    assert 0 < m["ckpt_fsync_s"] < m["ckpt_write_s"] and m["ckpt_commit_s"] > 0, m
    assert m["ckpt_save_s"] >= m["ckpt_write_s"] + m["ckpt_commit_s"], m
    assert verify(path) == [] and _reloaded(saver, path, named, opt)
    size = path.stat().st_size
    assert len(ranges) >= 30 * 8 * 3 // 64  # model/w and its moments, at least
    assert all(0 < n <= 64 + 40 and at + n <= size for at, n in ranges), ranges


def test_a_dataset_without_an_offset_is_written_through_hdf5(tmp_path, monkeypatch):
    """Where HDF5 gives no offset to write at (a dtype or layout not written in place), the
    ranks write that dataset through HDF5, in turn."""
    saver, named, opt = _saver(tmp_path, monkeypatch)
    _trained(named, opt)
    real = write.dataset_offset
    monkeypatch.setattr(write, "dataset_offset",
                        lambda d: None if d.name == "/model/b" else real(d))
    in_place = []
    real_runs = write.write_runs
    monkeypatch.setattr(write, "write_runs", lambda fd, base, buf, *a: (
        in_place.append(buf.size), real_runs(fd, base, buf, *a)))
    path = saver.save(1, named, opt, {})
    assert verify(path) == [] and _reloaded(saver, path, named, opt)
    # model/b through HDF5; its two moments (7,) and model/w's three (30,) in place
    assert in_place.count(7) == 2 and in_place.count(30) == 3, in_place
