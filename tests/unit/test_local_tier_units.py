"""The local tier without MPI: the partner of each rank lies on another node, the agreement
picks the newest generation that the surviving copies hold whole (and only when it is fresher
than the HDF5 file), a shard killed while written or with other bytes is never used, and the
shards' pieces assemble into global datasets that the writers' runs tile."""

import numpy as np
import pytest
import torch
from fakes import OneRank
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checkpoint import integrity as cv
from hpctrain.checkpoint import recover, shards
from hpctrain.checkpoint.layout import Piece
from hpctrain.checkpoint.local import partner_map


def nodes_of(sizes):
    """Every rank's (node leader, local rank, node size) for nodes of ``sizes`` ranks."""
    out, lead = [], 0
    for n in sizes:
        out += [(lead, i, n) for i in range(n)]
        lead += n
    return out


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_partner_is_the_same_local_rank_on_the_next_node(sizes):
    rows = nodes_of(sizes)
    partner = partner_map(rows)
    if len(sizes) == 1:
        assert partner == [None] * len(rows)
        return
    for r, p in enumerate(partner):
        assert rows[p][0] != rows[r][0]  # another node: losing one node keeps a copy
        leaders = sorted({lead for lead, _, _ in rows})
        nxt = leaders[(leaders.index(rows[r][0]) + 1) % len(leaders)]
        assert rows[p][0] == nxt and rows[p][1] == rows[r][1] % rows[p][2]
    if len(set(sizes)) == 1:  # equal nodes: every rank is some rank's partner once
        assert sorted(partner) == list(range(len(rows)))


@st.composite
def inventories(draw):
    """Current ranks' inventories of saved generations (saved world W, some shards lost)."""
    world = draw(st.integers(1, 5))
    saved = draw(st.integers(1, 5))
    invs = [[] for _ in range(world)]
    for step in draw(st.sets(st.integers(1, 6), max_size=3)):
        for r in range(saved):
            for c in draw(st.sets(st.integers(0, world - 1), max_size=2)):
                invs[c].append({"step": step, "rank": r, "world": saved, "dims": [saved],
                                "own": draw(st.booleans()), "file": f"{c}/{step}/{r}"})
    h5 = draw(st.one_of(st.none(), st.integers(0, 7)))
    return invs, h5, world, saved


@given(inventories())
@settings(max_examples=300, deadline=None)
def test_agreement_takes_the_newest_whole_generation_if_fresher(case):
    invs, h5, world, saved = case
    holds = {}
    for c, inv in enumerate(invs):
        for e in inv:
            holds.setdefault(e["step"], {}).setdefault(e["rank"], set()).add(c)
    whole = [s for s, by in holds.items() if set(by) == set(range(saved))]
    got = recover.agree(invs, h5, world, [world])
    if not whole:
        assert got is None
        return
    step = max(whole)
    fast = saved == world and all(r in holds[step][r] for r in range(saved))
    if h5 is not None and (step < h5 or (step == h5 and not fast)):
        assert got is None
        return
    assert got["step"] == step and got["fast"] == fast and got["world"] == saved
    assert set(got["holders"]) == set(range(saved))
    for r, c in got["holders"].items():
        assert c in holds[step][r]  # the rank that reads a shard holds it
        assert not fast or c == r


def test_agreement_refuses_mixed_layouts_at_one_step():
    one = {"step": 4, "rank": 0, "own": True, "file": "x"}
    invs = [[{**one, "world": 1, "dims": [1]}], [{**one, "world": 2, "dims": [2]}]]
    assert recover.agree(invs, None, 2, [2]) is None


RUN = "run-a"


def shard(folder, step, rank, data: np.ndarray, world=1, killer=None, run=RUN):
    piece = Piece("model/w", data.shape, data.dtype, torch.from_numpy(data), True)
    piece.parts.append((lambda t: t, ((0,) * data.ndim, data.shape)))
    table, bufs = shards.encode({"model/w": piece}, {"model/w": data.reshape(-1)},
                                {"model/w": True})
    crc, n = shards.crc_of(bufs)
    marker = {"format": shards.MARKER_FORMAT, "run": run, "step": step, "rank": rank,
              "world": world,
              "dims": [world], "node": "here", "crc32": crc, "bytes": n, "pieces": table,
              "meta": {"step": step}}
    shards.write_shard(folder / shards.gen_name(step), marker, bufs, killer=killer)


def test_a_shard_is_listed_only_once_committed_and_sound(tmp_path):
    data = np.arange(12, dtype=np.float64).reshape(3, 4)
    shard(tmp_path, 2, 0, data)
    shard(tmp_path, 4, 0, data)
    listed, torn, foreign = shards.inventory(tmp_path, "here", RUN)
    assert [(e["step"], e["rank"], e["own"]) for e in listed] == [(2, 0, True), (4, 0, True)]
    assert torn == [] and foreign == []
    assert shards.inventory(tmp_path, "elsewhere", RUN)[0][0]["own"] is False
    gen4 = tmp_path / "step_00000004"
    # killed between the bytes and the marker: bytes there, no marker -> not listed
    (gen4 / "rank_00000.json").unlink()
    listed, torn, _ = shards.inventory(tmp_path, "here", RUN)
    assert [e["step"] for e in listed] == [2]
    assert torn == ["step 4 rank 0: no committed marker (the write was cut short)"]
    # the marker there but other bytes of the same size: listed, refused by its CRC
    shard(tmp_path, 4, 0, data)
    raw = bytearray((gen4 / "rank_00000.bin").read_bytes())
    raw[5] ^= 0xFF
    (gen4 / "rank_00000.bin").write_bytes(bytes(raw))
    assert "CRC-32" in shards.sound(str(gen4 / "rank_00000.bin"))
    choice, dropped = recover.choose(OneRank(), shards.inventory(tmp_path, "here", RUN)[0],
                                     None, [1])
    assert choice["step"] == 2 and len(dropped) == 1  # the previous generation
    # truncated: not listed at all
    (gen4 / "rank_00000.bin").write_bytes(bytes(raw[:10]))
    listed, torn, _ = shards.inventory(tmp_path, "here", RUN)
    assert [e["step"] for e in listed] == [2] and "10 bytes, the marker records" in torn[0]
    assert shards.sound(str(tmp_path / "step_00000002" / "rank_00000.bin")) == ""
    marker, arrays = shards.load_shard(str(tmp_path / "step_00000002" / "rank_00000.bin"))
    assert marker["meta"] == {"step": 2}
    np.testing.assert_array_equal(arrays["model/w"].reshape(3, 4), data)


def test_another_runs_shards_are_never_listed_and_are_removed(tmp_path):
    """A run directory deleted and its path reused: the new run (another id) finds the old
    run's generations, lists none of them and removes them."""
    data = np.zeros(3)
    shard(tmp_path, 6, 0, data, run="old-run")
    shard(tmp_path, 2, 0, data)
    listed, torn, foreign = shards.inventory(tmp_path, "here", RUN)
    assert [e["step"] for e in listed] == [2] and torn == [] and len(foreign) == 2
    shards.remove(foreign)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    ids = {shards.run_identity(tmp_path / "ckpt") for _ in range(2)}
    assert len(ids) == 1 and (tmp_path / "ckpt" / shards.RUN_ID).is_file()  # made once


def test_newer_generations_are_dropped_and_old_ones_pruned(tmp_path):
    for step in (2, 4, 6):
        shard(tmp_path, step, 0, np.zeros(3))
    shards.drop_newer(tmp_path, 4)
    shards.prune(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


def test_writers_pieces_of_two_shards_assemble_into_the_global_dataset(tmp_path):
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    for rank, (rows, writes) in enumerate([((0, 2), True), ((2, 4), True), ((0, 2), False)]):
        part = full[rows[0]:rows[1]].copy()
        piece = Piece("model/w", (4, 6), part.dtype, torch.from_numpy(part), True)
        piece.parts.append((lambda t: t, ((rows[0], 0), part.shape)))
        table, bufs = shards.encode({"model/w": piece}, {"model/w": part.reshape(-1)},
                                    {"model/w": writes})
        crc, n = shards.crc_of(bufs)
        shards.write_shard(tmp_path, {"format": shards.MARKER_FORMAT, "step": 3, "rank": rank,
                                      "world": 3, "dims": [3], "node": "n", "crc32": crc,
                                      "bytes": n, "pieces": table, "meta": {}}, bufs)
    files = [str(tmp_path / f"rank_0000{r}.bin") for r in (1, 0, 2)]
    snap = recover.assembled(files, 3, {})
    piece, buf = snap.pieces["model/w"], snap.bufs["model/w"]
    assert len(piece.parts) == 2  # the non-writer replica's copy is not written twice
    out = np.empty(24, dtype=np.float32)
    pos = 0
    for offset, n in piece.runs():
        out[offset:offset + n] = buf[pos:pos + n]
        pos += n
    np.testing.assert_array_equal(out.reshape(4, 6), full)
    segs = cv.segments(buf, piece.runs())
    assert cv.join_segments(segs, full.nbytes)[1] == ""  # the runs tile the dataset


def test_an_unwritable_or_empty_local_dir_is_refused_before_any_collective(tmp_path,
                                                                          monkeypatch):
    import os
    import socket

    from hpctrain.checks import inputs
    from hpctrain.config import InputError, load

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(inputs.os, "access",
                        lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    ok = load("share/configs/tiny.toml", ["checkpoint.local_every=2",
                                          f'checkpoint.local_dir="{tmp_path}/w/{{node}}"'])
    inputs.check_inputs(ok, str(tmp_path / "run"))
    bad = load("share/configs/tiny.toml", ["checkpoint.local_every=2",
                                           f'checkpoint.local_dir="{ro}/{{node}}"'])
    with pytest.raises(InputError, match=f"{ro}/{socket.gethostname()} on this node.*not "
                                         "writable.*checkpoint.local_every=0"):
        inputs.check_inputs(bad, str(tmp_path / "run"))
    empty = load("share/configs/tiny.toml", ["checkpoint.local_every=2",
                                             'checkpoint.local_dir=""'])
    with pytest.raises(InputError, match="checkpoint.local_dir is empty"):
        inputs.check_inputs(empty, str(tmp_path / "run"))
    off = load("share/configs/tiny.toml", ['checkpoint.local_dir=""'])  # the tier off
    inputs.check_inputs(off, str(tmp_path / "run"))
