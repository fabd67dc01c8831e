"""The commit of a checkpoint without MPI (one rank, the serial writer): what is fsynced and
renamed in which order, and a dataset region that nobody writes is refused, not certified.
(Every rank's fsync under MPI-IO: tests/mpi/test_checkpoint_commit_mpi.py.)"""

import os
from pathlib import Path

import pytest
import torch
from fakes import fake_topology

from hpctrain.checkpoint import checkpointer
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
