"""Checkpoint pieces without MPI: flat-range boxes, hyperslab round trips for tp shards with
padding and ZeRO flat shards onto another layout, checksums, damage detection."""


import h5py
import numpy as np
import pytest
import torch
from fakes import fake_topology

from hpctrain.checkpoint import integrity as cv
from hpctrain.checkpoint.layout import flat_boxes, flat_piece, shard_piece, transfer
from hpctrain.model.stage import ParamMeta, local_slice


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_flat_boxes_cover_every_range_in_order(shape):
    n = int(np.prod(shape))
    flat = np.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            got = []
            for off, (start, count) in flat_boxes(shape, a, b):
                box = flat[tuple(slice(s, s + c) for s, c in zip(start, count))].reshape(-1)
                assert box[0] == off and np.all(np.diff(box) == 1)  # contiguous in flat order
                got.extend(box.tolist())
            assert got == list(range(a, b))
            assert len(flat_boxes(shape, a, b)) <= 2 * len(shape) - 1 or a == b


def _local(full, meta, tp, r):
    """This tp rank's padded local tensor, as the model holds it."""
    index, extent = local_slice(meta, tp, r)
    shape = list(meta.global_shape)
    if meta.tp_dim is not None:
        shape[meta.tp_dim] = -(-shape[meta.tp_dim] // tp)
    t = torch.zeros(shape, dtype=torch.float64)
    t[tuple(slice(0, n) for n in extent)] = full[index]
    return t


@pytest.mark.parametrize("tp_dim, shape", [(0, (5, 4)), (1, (5, 6)), (None, (3, 2))])
@pytest.mark.parametrize("save, load", [((2, 3), (3, 2)), ((1, 4), (2, 1))])
def test_zero_flat_shards_round_trip_onto_another_layout(tmp_path, tp_dim, shape, save, load):
    """Save as (tp, dp) flat ZeRO shards (padding rows included), load as other ones."""
    meta = ParamMeta(shape, tp_dim=tp_dim)
    full = torch.arange(np.prod(shape), dtype=torch.float64).reshape(shape) + 1
    path = tmp_path / "z.h5"
    with h5py.File(path, "w") as f:
        dset = f.create_dataset("optim/p/exp_avg", shape=shape, dtype="f8")
        tp, dp = save
        for r in range(tp):
            local = _local(full, meta, tp, r)
            n = local.numel()
            for d in range(dp):
                a, b = d * -(-n // dp), min(n, (d + 1) * -(-n // dp))
                shard = local.reshape(-1)[a:b].clone()
                piece = flat_piece(dset.name, shard, meta, local.shape, a, b,
                                   fake_topology(tp, r, dp, d), writes=True)
                transfer(dset, piece, write=True, collective=False)
        assert torch.equal(torch.from_numpy(dset[...]), full)
        tp, dp = load
        for r in range(tp):
            local = _local(full, meta, tp, r)
            n = local.numel()
            for d in range(dp):
                a, b = d * -(-n // dp), min(n, (d + 1) * -(-n // dp))
                shard = torch.full((b - a,), -1.0, dtype=torch.float64)
                piece = flat_piece(dset.name, shard, meta, local.shape, a, b,
                                   fake_topology(tp, r, dp, d), writes=True)
                piece.scatter(transfer(dset, piece, write=False, collective=False))
                want = local.reshape(-1)[a:b]
                real = torch.zeros_like(local, dtype=torch.bool)
                _, extent = local_slice(meta, tp, r)
                real[tuple(slice(0, e) for e in extent)] = True
                mask = real.reshape(-1)[a:b]
                assert torch.equal(shard[mask], want[mask])
                assert torch.all(shard[~mask] == -1)  # padding is left alone


def test_shard_piece_skips_padding_and_round_trips(tmp_path):
    meta = ParamMeta((5, 3), tp_dim=0)
    full = torch.randn(5, 3, dtype=torch.float64)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        dset = f.create_dataset("model/w", shape=(5, 3), dtype="f8")
        for r in range(2):
            topo = fake_topology(2, r)
            piece = shard_piece("model/w", _local(full, meta, 2, r), meta, topo, True)
            transfer(dset, piece, write=True, collective=False)
        assert np.array_equal(dset[...], full.numpy())


def _ckpt(path, data):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = cv.FORMAT
        for name, arr in data.items():
            f.create_dataset(name, data=arr)
    cv.stamp(path, cv.compute_checksums(path, list(data)))


def test_checksum_is_independent_of_block_size(tmp_path, monkeypatch):
    arr = np.random.default_rng(0).standard_normal((300, 7))
    _ckpt(tmp_path / "c.h5", {"model/a": arr})
    import zlib

    whole = zlib.crc32(arr.astype("<f8").tobytes())
    monkeypatch.setattr(cv, "BLOCK_BYTES", 7 * 8 * 3)  # 3 rows per block
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert cv.crc32_dataset(f["model/a"]) == whole == int(f["model/a"].attrs["crc32"])
    assert cv.verify(tmp_path / "c.h5") == []


def test_flipped_bytes_and_truncation_are_detected(tmp_path):
    arr = np.arange(4096, dtype=np.float64)
    good = tmp_path / "good.h5"
    _ckpt(good, {"model/a": arr, "model/b": arr[:10].copy()})
    raw = bytearray(good.read_bytes())
    pos = raw.find(arr[1000:1004].tobytes())
    assert pos > 0
    flipped = tmp_path / "flipped.h5"
    raw[pos + 3] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    problems = cv.verify(flipped)
    assert problems == ["model/a: checksum mismatch"], problems
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[: len(raw) // 2])
    problems = cv.verify(truncated)
    assert problems and ("cannot open" in problems[0] or "unreadable" in problems[0])
    # a share of the datasets: only those are checked
    assert cv.verify(flipped, (1, 2)) == []


def test_rng_layout_of_a_checkpoint_from_before_cp_reads_with_cp_1():
    """A 4-dim rng_layout (pp, dp_outer, ep, tp) is the same rank order as cp = 1, so its
    RNG states are restored on that layout (not silently dropped)."""
    from hpctrain.checkpoint.checkpointer import _rng_dims

    assert _rng_dims("(2, 1, 1, 2)") == (2, 1, 1, 1, 2)
    assert _rng_dims(b"(1, 2, 1, 1, 4)") == (1, 2, 1, 1, 4)
    assert _rng_dims(None) is None and _rng_dims("not dims") is None
