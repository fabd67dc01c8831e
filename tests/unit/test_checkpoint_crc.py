"""Checksums from memory (no MPI): the runs of any set of boxes that tile a global array,
CRC'd piece by piece in any order and joined, give the CRC-32 that a reader of the whole
array computes; gaps and overlaps are named. ``checkpoint.verify_write`` reads the file back
and refuses a file whose bytes differ from what was in memory; ``checkpoint.async`` spelled
as TOML."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checkpoint import checkpointer, write
from hpctrain.checkpoint import integrity as cv
from hpctrain.checkpoint.layout import box_runs, flat_boxes
from hpctrain.config import CheckpointConfig, dumps_toml, load


@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32_combine_is_zlibs(a, b):
    assert cv.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@st.composite
def tiled(draw):
    """A global shape and boxes that tile it: cuts along every dimension."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    cuts = [sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2))) | {0, n})
            for n in shape]
    boxes = [((), ())]
    for edges in cuts:
        boxes = [((*s, lo), (*c, hi - lo)) for s, c in boxes
                 for lo, hi in zip(edges, edges[1:]) if hi > lo]
    return shape, draw(st.permutations(boxes))


@settings(max_examples=150, deadline=None)
@given(case=tiled(), dtype=st.sampled_from(["<f8", "<f4", "u1"]))
def test_runs_of_boxes_give_the_whole_arrays_crc(case, dtype):
    shape, boxes = case
    arr = np.arange(int(np.prod(shape)), dtype=np.float64).astype(dtype).reshape(shape)
    segs = []
    for start, count in boxes:  # as each writer would: its box in C order, then its runs
        sel = tuple(slice(s, s + c) for s, c in zip(start, count))
        buf = np.ascontiguousarray(arr[sel]).reshape(-1)
        runs = box_runs(shape, start, count)
        assert sum(n for _, n in runs) == buf.size
        for (offset, n), got in zip(runs, np.split(buf, np.cumsum([n for _, n in runs])[:-1])):
            assert np.array_equal(arr.reshape(-1)[offset:offset + n], got)
        segs += cv.segments(buf, runs)
    crc, why = cv.join_segments(segs, arr.nbytes)
    assert why == "" and crc == zlib.crc32(arr.tobytes())


def test_zero_flat_boxes_runs_and_a_gap_or_overlap_named():
    shape = (4, 5)
    arr = np.arange(20, dtype="<f8").reshape(shape)
    segs = []
    for a, b in ((0, 7), (7, 13), (13, 20)):  # three ZeRO shards of the flattened tensor
        for off, (start, count) in flat_boxes(shape, a, b):
            buf = arr.reshape(-1)[off:off + int(np.prod(count))]
            segs += cv.segments(buf, box_runs(shape, start, count))
    assert cv.join_segments(segs, arr.nbytes) == (zlib.crc32(arr.tobytes()), "")
    assert cv.join_segments(segs[1:], arr.nbytes)[1].startswith("a gap at byte 0")
    assert "an overlap" in cv.join_segments(segs + segs[:1], arr.nbytes)[1]
    assert cv.join_segments(segs[:-1], arr.nbytes)[1] == f"{arr.nbytes - segs[-1][1]} of " \
                                                         f"{arr.nbytes} bytes written"


def _serial_saver(tmp_path, monkeypatch, **cfg):
    from test_checkpoint_commit import _saver  # the one-rank world of the commit tests

    saver, named, opt = _saver(tmp_path, monkeypatch)
    saver.cfg = saver.writer.cfg = CheckpointConfig(**cfg)
    return saver, named, opt


@pytest.mark.parametrize("verify", [True, False])
def test_verify_write_refuses_bytes_that_differ_from_memory(tmp_path, monkeypatch, verify):
    """A write that corrupts one dataset on its way to the file: with verify_write the file
    is not committed and `latest` stays; without it the checksum still catches it on load."""
    saver, named, opt = _serial_saver(tmp_path, monkeypatch, verify_write=verify)
    first = saver.save(1, named, opt, {})
    real = write.write_runs
    seen = []

    def corrupting(fd, base, buf, runs, flush):  # in sorted order: model/b, model/w, ...
        seen.append(buf.size)
        if len(seen) == 2:  # model/w's 6 x 5
            assert buf.size == 30
            buf = buf.copy()
            buf[3] += 1.0  # what reaches the file is not what was in memory
        return real(fd, base, buf, runs, flush)

    monkeypatch.setattr(write, "write_runs", corrupting)
    if verify:
        with pytest.raises(checkpointer.CorruptCheckpoint, match=r"model/w"):
            saver.save(2, named, opt, {})
        assert checkpointer.latest(saver.dir) == first
        assert sorted(p.name for p in saver.dir.iterdir()) == ["commits.jsonl", "latest",
                                                               first.name]
    else:
        second = saver.save(2, named, opt, {})
        assert cv.verify(second) == ["model/w: checksum mismatch"]


def test_async_is_the_toml_key_and_round_trips(tmp_path):
    cfg = load(None, ["checkpoint.async=true", "checkpoint.verify_write=true"])
    assert cfg.checkpoint.async_ and cfg.checkpoint.verify_write
    text = dumps_toml(cfg)
    assert "async = true" in text and "async_" not in text
    (tmp_path / "c.toml").write_text(text)
    assert load(tmp_path / "c.toml") == cfg
    with pytest.raises(ValueError, match="unknown key checkpoint.async_; valid keys .*async"):
        load(None, ["checkpoint.async_=true"])


def test_snapshot_for_async_is_a_copy_the_next_step_cannot_touch():
    from hpctrain.checkpoint.layout import Piece

    t = torch.arange(6, dtype=torch.float64)
    piece = Piece("model/x", (6,), np.dtype("<f8"), t, True)
    piece.parts.append((lambda x: x, ((0,), (6,))))
    live = write.snapshot(1, {"model/x": piece}, {}, copy=False)
    private = write.snapshot(1, {"model/x": piece}, {}, copy=True)
    t.add_(100.0)  # the optimizer's next step
    assert live.bufs["model/x"][0] == 100.0  # (synchronous saves write before the step)
    assert np.array_equal(private.bufs["model/x"], np.arange(6.0))
