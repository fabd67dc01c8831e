"""A ZeRO checkpoint under MPI-IO at any world size (run under mpirun; every rank is one dp
rank): each rank writes and reads only its own shards, and every rank closes the file and
fsyncs its writes before rank 0 renames it."""

import json
import os
import time
from pathlib import Path

import h5py
import pytest
import torch
from fakes import fake_topology

from hpctrain import comm
from hpctrain.checkpoint import checkpointer
from hpctrain.checkpoint.integrity import describe
from hpctrain.cli import inspect
from hpctrain.config import CheckpointConfig, OptimConfig
from hpctrain.model.stage import ParamMeta
from hpctrain.optim import build_optimizer
from hpctrain.parallel import grad_sync

pytestmark = pytest.mark.mpi

SHAPES = {"vec": (37,), "mat": (5, 23), "w": (4, 6)}


@pytest.fixture(scope="module")
def topo():
    world = comm.world()
    dp = comm.Group(world.mpi.Dup(), "dp")
    return fake_topology(group=dp)


def _zero(topo):
    named = []
    for name, shape in SHAPES.items():
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        p.hp = ParamMeta(shape)
        named.append((name, p))
    grads = grad_sync.create(named, topo, 300 / 2**20, zero=1)
    return named, build_optimizer(named, OptimConfig(zero=1), topo, grads, "float64")


def test_zero_shards_saved_in_place_and_synced_by_every_rank(topo, mpi_tmp_path, monkeypatch):
    if not checkpointer.h5py_has_mpi():
        pytest.fail("h5py without MPI: this test is about the MPI-IO writer")
    monkeypatch.delenv(checkpointer.SERIAL_ENV, raising=False)
    named, opt = _zero(topo)
    for st, b in zip(opt.shards, opt.grads.buckets):  # moments = global element index
        lo, hi = b.shard_range
        for k, t in st.items():
            t.copy_(torch.arange(lo, hi, dtype=t.dtype) + (0.5 if k == "exp_avg_sq" else 0))
    want = opt.state  # the gathered copy (collective), for comparison only
    events = []
    real_fsync, real_replace, real_close = os.fsync, os.replace, h5py.File.close
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        (time.monotonic(), "fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name)),
        real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(
        (time.monotonic(), "replace", Path(a).name)), real_replace(a, b)))
    monkeypatch.setattr(h5py.File, "close", lambda f: (events.append(
        (time.monotonic(), "close", "")), real_close(f)))
    saver = checkpointer.Checkpointer(CheckpointConfig(), topo, mpi_tmp_path,
                               collective_min_bytes=64)
    final = saver.save(3, named, opt, {})
    every = topo.world.allgather_obj(events)
    tmp = f".{final.name}.tmp"
    renamed = [t for t, what, name in every[0] if what == "replace" and name == tmp]
    assert len(renamed) == 1, every[0]
    for r, ev in enumerate(every):
        synced = [t for t, what, name in ev if what == "fsync" and name == tmp]
        closed = [t for t, what, _ in ev if what == "close"]
        assert synced and min(synced) < renamed[0], f"rank {r} did not fsync before the rename"
        assert closed and min(closed) < min(synced), f"rank {r}: fsync before the close"
    with h5py.File(final, "r") as f:  # every rank's shard landed in the global datasets
        for name in SHAPES:
            for key in ("exp_avg", "exp_avg_sq"):
                got = torch.from_numpy(f[f"optim/{name}/{key}"][...])
                assert torch.equal(got, want[name][key]), (name, key)
    named2, opt2 = _zero(topo)  # and each rank reads back exactly its own shards
    saver.load(final, named2, opt2)
    mine, back = opt.local_state(), opt2.local_state()  # (bucket padding is no state)
    assert set(mine) == set(back)
    for name in mine:
        for k in mine[name]:
            assert torch.equal(mine[name][k], back[name][k]), (name, k)


LUSTRE_GPFS_HINTS = {"striping_factor": "4", "striping_unit": "1048576",
                     "romio_cb_write": "enable", "cb_nodes": "2"}


@pytest.mark.parametrize("collective_io", [False, True])
def test_site_hints_pass_through_unchanged_and_inspect_shows_them(topo, mpi_tmp_path, monkeypatch,
                                                                  capsys, collective_io):
    """The MPI-IO hints that matter on Lustre and GPFS reach MPI_File_open verbatim (the
    MPI.Info handed to HDF5), are recorded in the file with those MPI applied
    (MPI_File_get_info), and `inspect` shows both with the alignment: every dataset of >=
    64 KiB starts on a stripe (1 MiB) boundary."""
    if not checkpointer.h5py_has_mpi():
        pytest.fail("h5py without MPI: this test is about the MPI-IO writer")
    monkeypatch.delenv(checkpointer.SERIAL_ENV, raising=False)
    opened, applied = [], []
    real_info, real_applied = comm.mpi_info, comm.applied_hints

    def recording_info(hints):
        info = real_info(hints)
        opened.append({k: info.Get(k) for k in LUSTRE_GPFS_HINTS})
        return info

    def recording_applied(*a):
        applied.append(real_applied(*a))
        return applied[-1]

    monkeypatch.setattr(comm, "mpi_info", recording_info)
    monkeypatch.setattr(comm, "applied_hints", recording_applied)
    named = []
    for name, shape in (("big", (64, 1024)), ("small", (3, 5))):  # 512 KiB and 120 B
        p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
        p.hp = ParamMeta(shape)
        named.append((name, p))
    opt = build_optimizer(named, OptimConfig(), topo, grad_sync.create(named, topo, 1.0),
                          "float64")
    cfg = CheckpointConfig(mpi_hints=LUSTRE_GPFS_HINTS, alignment=1 << 20,
                           collective_io=collective_io)
    saver = checkpointer.Checkpointer(cfg, topo, mpi_tmp_path)
    final = saver.save(1, named, opt, {})
    assert opened and all(o == LUSTRE_GPFS_HINTS for o in opened), opened
    assert len(applied) == 1 and applied[0], applied  # probed once, at the first save
    if topo.world.rank == 0:
        lines = inspect.io_settings(describe(final))
        assert lines[0] == "mpi_hints          " + json.dumps(LUSTRE_GPFS_HINTS, sort_keys=True)
        assert lines[1] == "mpi_hints applied  " + json.dumps(applied[0], sort_keys=True)
        assert lines[2] == ("alignment          1048576 bytes: 3 of 3 datasets of >= 65536 "
                            "bytes start on it")  # model/big and its two moments
        io = "collective MPI-IO" if collective_io else "independent (own hyperslabs)"
        assert lines[3] == f"io                 {io}"
    topo.world.barrier()
