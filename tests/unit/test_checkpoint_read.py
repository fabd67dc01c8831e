"""Loads without MPI (checkpoint/read.py): strided pieces copied from a memory map and
contiguous ones read with ``preadv`` equal what HDF5's hyperslab read gives, for tp column
and row shards with padding, 3-D boxes, ZeRO flat boxes, 16-bit tensors and a file dtype
other than the tensor's; big-endian contiguous and chunked datasets go through HDF5."""

import itertools

import h5py
import numpy as np
import pytest
import torch
from fakes import fake_topology

from hpctrain.checkpoint import read
from hpctrain.checkpoint.layout import box_runs, flat_piece, shard_piece, transfer
from hpctrain.model.stage import ParamMeta


@pytest.mark.parametrize("shape", [(4,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_contiguous_is_one_run(shape):
    for start in itertools.product(*(range(n) for n in shape)):
        for count in itertools.product(*(range(1, n - s + 1) for n, s in zip(shape, start))):
            assert read.contiguous(shape, start, count) == (
                len(box_runs(shape, start, count)) == 1), (start, count)


def _pieces(meta, tp, dtype, zero_dp=0):
    """Every tp rank's (and dp rank's, ZeRO) pieces of ``model/w``, filled with -1."""
    out = []
    for r in range(tp):
        topo = fake_topology(tp, r)
        shape = list(meta.global_shape)
        if meta.tp_dim is not None:
            shape[meta.tp_dim] = -(-shape[meta.tp_dim] // tp)
        if not zero_dp:
            out.append(shard_piece("model/w", torch.full(shape, -1.0, dtype=dtype), meta,
                                   topo, True))
            continue
        n = int(np.prod(shape))
        for d in range(zero_dp):
            a, b = d * -(-n // zero_dp), min(n, (d + 1) * -(-n // zero_dp))
            out.append(flat_piece("model/w", torch.full((b - a,), -1.0, dtype=dtype), meta,
                                  shape, a, b, topo, True))
    return out


CASES = [  # (global shape, tp_dim, tp, file dtype, tensor dtype, ZeRO dp, chunked)
    ((7, 5), 1, 2, "<f8", torch.float64, 0, False),  # column split with padding
    ((3, 4, 6), 2, 4, "<f8", torch.float64, 0, False),  # 3-D, last dim split
    ((4, 6, 5), 1, 3, ">f4", torch.float32, 0, False),  # big-endian file
    ((6, 8), 1, 2, "<f4", torch.bfloat16, 0, False),  # 16-bit tensor, float32 file
    ((12, 9), 1, 2, "<f8", torch.float64, 3, False),  # ZeRO flat boxes of column shards
    ((6, 8), 1, 2, "<f8", torch.float64, 0, True),  # chunked: HDF5 reads it
    ((8, 6), 0, 2, "<f8", torch.float64, 0, False),  # row split: contiguous, preadv
    ((7, 6), 0, 2, "<f8", torch.float32, 0, False),  # padded rows, float64 file: a buffer
    ((8, 6), 0, 2, ">f4", torch.float32, 0, False),  # big-endian contiguous: HDF5
    ((12, 9), 0, 3, "<f4", torch.bfloat16, 2, False),  # ZeRO boxes of row shards, 16-bit
]


@pytest.mark.parametrize("shape, tp_dim, tp, fdt, tdt, dp, chunked", CASES)
def test_mapped_read_equals_hdf5_read(tmp_path, monkeypatch, shape, tp_dim, tp, fdt, tdt,
                                      dp, chunked):
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 0.5 + 1
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("pad", data=np.zeros(3, "u1"))  # the dataset does not start at 0
        f.create_dataset("model/w", data=full.astype(fdt), chunks=(2,) * len(shape)
                         if chunked else None)
    meta = ParamMeta(shape, tp_dim=tp_dim)
    mapped, preads = [], []
    real = read.mapped_read
    monkeypatch.setattr(read, "mapped_read", lambda *a: (mapped.append(1), real(*a)))
    real_runs = read.FileBytes.read_runs
    monkeypatch.setattr(read.FileBytes, "read_runs",
                        lambda *a: (preads.append(1), real_runs(*a)))
    with h5py.File(path, "r") as f:
        got, want = _pieces(meta, tp, tdt, dp), _pieces(meta, tp, tdt, dp)
        for g, w in zip(got, want):
            read.read_pieces(f, path, ["model/w"], {"model/w": g}, 1 << 62, False)
            w.scatter(transfer(f["model/w"], w, write=False, collective=False))
            assert torch.equal(g.tensor, w.tensor)
            assert (g.tensor != -1).any() or not g.parts
            assert (g.tensor == -1).any() == (w.tensor == -1).any()  # padding left alone
    expected = 0 if chunked else sum(read.strided(p) for p in got)
    assert len(mapped) == expected and (expected > 0) == (tp_dim != 0 and not chunked)
    contiguous = sum(not read.strided(p) and bool(p.parts) for p in got)
    native = np.dtype(fdt).isnative
    assert len(preads) == (0 if chunked or not native else contiguous)
    assert (len(preads) > 0) == (tp_dim == 0 and native)


def test_a_file_system_without_mmap_falls_back_to_hdf5(tmp_path, monkeypatch):
    shape = (6, 8)
    full = np.arange(48, dtype=np.float64).reshape(shape)
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("model/w", data=full)

    def refuse(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(read.mmap, "mmap", refuse)
    with h5py.File(path, "r") as f:
        for piece in _pieces(ParamMeta(shape, tp_dim=1), 2, torch.float64):
            assert read.strided(piece)
            read.read_pieces(f, path, ["model/w"], {"model/w": piece}, 1 << 62, False)
            c0 = piece.parts[0][1][0][1]  # the box's first column
            assert torch.equal(piece.tensor, torch.from_numpy(full[:, c0:c0 + 4]))
