"""What an import refuses of a foreign checkpoint (docs/interchange.md), in process on tiny
DCP directories made with torch's own writer (``dcp.save(..., no_dist=True)``) in torchtitan's
or Megatron-Core's names for share/configs/tiny-llama.toml's model, and tiny Hugging Face
directories: a truncated, missing or damaged ``.distcp``, chunks that leave a gap or overlap,
a vocabulary padded beyond its writer's rule, a destination that already holds something,
and paths in a checkpoint's own metadata leading out of it. Each is one message, exit 2,
and nothing written or changed."""

import json
import os
import pickle
import shutil
import time
from argparse import Namespace
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from hpctrain.__main__ import main
from hpctrain.config import load
from hpctrain.interchange import chunks, hf_map, megatron, pickles, titan
from hpctrain.interchange.trainers import model_shapes
from hpctrain.model.families import resolved

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny-llama.toml")
SETS = ("model.n_layers=1", "model.dtype=float32")
EMBED = "tok_embeddings.weight"


def model(*sets):
    return resolved(load(TINY, [*SETS, *sets]).model)


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def refused(capsys, *args) -> str:
    rc, out, err = cli(capsys, *args)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    return err


def import_args(src, out, *sets):
    return ("import", "--format", "dcp", src, "--config", TINY, "--out", out,
            *[a for s in (*SETS, *sets) for a in ("--set", s)])


def save(directory: Path, state: dict) -> dict:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return state


def titan_dcp(directory: Path, *sets) -> dict:
    """torchtitan's Llama 3 state of the model (weights only, random values)."""
    m = model(*sets)
    g = torch.Generator().manual_seed(0)
    shapes = titan.TitanForm(m, titan.TitanNames()).expected(model_shapes(m))
    return save(directory, {k: torch.randn(s, generator=g) for k, s in shapes.items()})


def rewrite(directory: Path, change) -> None:
    """``change(metadata)``, then the metadata written back."""
    meta = pickles.load_dcp_metadata(directory / ".metadata")
    change(meta)
    (directory / ".metadata").write_bytes(pickle.dumps(meta))


def two_chunks(directory: Path, key: str = EMBED, cut: int = 128) -> torch.Tensor:
    """A torchtitan DCP whose ``key`` is stored as two ranks store it: rows [0, cut) and
    [cut, end) in chunks of their own (saved as two entries, whose records the metadata then
    gives to ``key``'s two chunks)."""
    m = model()
    g = torch.Generator().manual_seed(0)
    shapes = titan.TitanForm(m, titan.TitanNames()).expected(model_shapes(m))
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    whole = state.pop(key)
    save(directory, {**state, f"{key}#0": whole[:cut].clone(), f"{key}#1": whole[cut:].clone()})

    def merge(meta):
        parts = [meta.state_dict_metadata.pop(f"{key}#{i}") for i in (0, 1)]
        offsets = [torch.Size([0, 0]), torch.Size([cut, 0])]
        meta.state_dict_metadata[key] = TensorStorageMetadata(
            parts[0].properties, whole.shape,
            [ChunkStorageMetadata(o, p.size) for o, p in zip(offsets, parts)])
        for i, o in enumerate(offsets):
            record = meta.storage_data.pop(MetadataIndex(f"{key}#{i}", [0, 0]))
            meta.storage_data[MetadataIndex(key, o)] = record

    rewrite(directory, merge)
    return whole


def last_record(directory: Path):
    meta = pickles.load_dcp_metadata(directory / ".metadata")
    return max(meta.storage_data.items(), key=lambda kv: kv[1].offset)


# -- item 4: a truncated, missing or damaged .distcp ---------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_distcp_is_one_message_and_nothing_made(tmp_path, capsys, damage):
    titan_dcp(tmp_path / "d")
    (index, record) = last_record(tmp_path / "d")
    distcp = tmp_path / "d" / record.relative_path
    if damage == "truncated":
        distcp.write_bytes(distcp.read_bytes()[:record.offset + record.length // 2])
    else:
        distcp.unlink()
    err = refused(capsys, *import_args(tmp_path / "d", tmp_path / "new" / "ckpt"))
    assert str(distcp) in err and damage in err, err
    assert not (tmp_path / "new").exists()


def test_distcp_damaged_inside_is_one_message_and_leaves_nothing(tmp_path, capsys):
    """The last tensor's bytes zeroed (the file keeps its length): found while writing,
    after other tensors were written; no directory, temporary file or `latest` is left."""
    titan_dcp(tmp_path / "d")
    index, record = last_record(tmp_path / "d")
    distcp = tmp_path / "d" / record.relative_path
    data = bytearray(distcp.read_bytes())
    data[record.offset:record.offset + record.length] = bytes(record.length)
    distcp.write_bytes(bytes(data))
    err = refused(capsys, *import_args(tmp_path / "d", tmp_path / "new" / "ckpt"))
    assert index.fqn in err and str(distcp) in err and "damaged" in err, err
    assert not (tmp_path / "new").exists()


def test_export_dcp_onto_a_file_is_refused(tmp_path, capsys):
    titan_dcp(tmp_path / "d")
    assert cli(capsys, *import_args(tmp_path / "d", tmp_path / "t.h5"))[0] == 0
    (tmp_path / "there").write_text("mine")
    err = refused(capsys, "export", tmp_path / "t.h5", "--format", "dcp", "--out",
                  tmp_path / "there")
    assert str(tmp_path / "there") in err and "directory" in err
    assert (tmp_path / "there").read_text() == "mine"


# -- item 5: chunk coverage ---------------------------------------------------------------

def test_two_ranks_chunks_import(tmp_path, capsys):
    whole = two_chunks(tmp_path / "d")
    assert cli(capsys, *import_args(tmp_path / "d", tmp_path / "t.h5"))[0] == 0
    with h5py.File(tmp_path / "t.h5") as f:
        assert np.array_equal(f["model/embed"][...], whole.numpy())


def omit(meta):
    meta.state_dict_metadata[EMBED].chunks.pop()


def overlap(meta):
    first = meta.state_dict_metadata[EMBED].chunks[0]
    meta.state_dict_metadata[EMBED].chunks[0] = ChunkStorageMetadata(
        first.offsets, torch.Size([192, 32]))
    meta.state_dict_metadata[EMBED].chunks[1] = ChunkStorageMetadata(
        torch.Size([64, 0]), torch.Size([192, 32]))


def outside(meta):
    last = meta.state_dict_metadata[EMBED].chunks[1]
    meta.state_dict_metadata[EMBED].chunks[1] = ChunkStorageMetadata(
        torch.Size([128, 0]), torch.Size([256, 32]))
    assert last.sizes == torch.Size([128, 32])


def unrecorded(meta):
    del meta.storage_data[MetadataIndex(EMBED, [128, 0])]


@pytest.mark.parametrize("change, words", [
    (omit, "[128:256, 0:32] (rows 128 to 255) is in no chunk"),
    (overlap, "[64:192, 0:32] (rows 64 to 191) is in 2 chunks"),
    (outside, "lies outside the tensor ([128:384, 0:32]"),
    (unrecorded, "at offsets (128, 0) has no storage record"),
], ids=["gap", "overlap", "outside", "no-record"])
def test_chunks_that_do_not_cover_a_tensor_exactly_once_are_refused(tmp_path, capsys, change,
                                                                    words):
    """Before c58ae28's reader the omitted chunk imported with exit 0 and whatever the
    destination's memory held."""
    two_chunks(tmp_path / "d")
    rewrite(tmp_path / "d", change)
    err = refused(capsys, *import_args(tmp_path / "d", tmp_path / "out.h5"))
    assert EMBED in err and words in err, err
    assert not (tmp_path / "out.h5").exists()


def grid(rows: int, cols: int, h: int, w: int) -> list:
    return [((i, j), (h, w)) for i in range(0, rows, h) for j in range(0, cols, w)]


def test_coverage_of_many_chunks_is_checked_in_one_sweep():
    """Thousands of ranks' chunks (a 1-D split into 20,000, a 2-D grid of 150 x 150 shuffled)
    are checked in well under a second each; a gap or an overlap among them is found and
    named."""
    rng = np.random.default_rng(0)
    one = [((i * 3,), (3,)) for i in range(20_000)]
    two = grid(300, 600, 2, 4)
    rng.shuffle(two)
    for shape, boxes in (((60_000,), one), ((300, 600), two)):
        start = time.perf_counter()
        assert chunks.cover_problem(shape, boxes) is None
        assert time.perf_counter() - start < 1.5
    assert "[30:33] (rows 30 to 32) is in no chunk" in chunks.cover_problem(
        (60_000,), one[:10] + one[11:])
    assert "[1:2, 1:2] (rows 1 to 1) is in 2 chunks" in chunks.cover_problem(
        (300, 600), two + [((1, 1), (1, 1))])


def bricks(rows: int, cols: int) -> list:
    """A brick wall of 1 x 4 chunks, every other row shifted by half a brick."""
    out = []
    for r in range(rows):
        edges = list(range(0, cols + 1, 4)) if r % 2 == 0 else [0, *range(2, cols, 4), cols]
        out += [((r, a), (1, b - a)) for a, b in zip(edges, edges[1:])]
    return out


def test_irregular_layouts_are_checked_by_the_sweep(monkeypatch):
    """Past the grid's budget the sweep finds the same problems; a matrix's chunks are
    compared with their neighbours only (20,000 chunks, 1,024 sharing each row, in well
    under the 20 M comparisons of all pairs that share rows)."""
    monkeypatch.setattr(chunks, "CELLS", 0)
    boxes = grid(8, 8, 2, 4)
    assert chunks.cover_problem((8, 8), boxes) is None
    assert "in the chunks at offsets (0, 3) and (0, 0)" in chunks.cover_problem(
        (8, 8), [((0, 3), (2, 1))] + boxes)
    assert "16 of its 64 elements are in no chunk" in chunks.cover_problem((8, 8), boxes[2:])
    wall = bricks(20, 4096)
    start = time.perf_counter()
    assert chunks.cover_problem((20, 4096), wall) is None
    assert time.perf_counter() - start < 3
    assert "[5:6, 9:10] (rows 5 to 5) is in the chunks" in chunks.cover_problem(
        (20, 4096), wall + [((5, 9), (1, 1))])
    boxes3 = [((0, *o), (2, *s)) for o, s in grid(8, 8, 2, 4)]
    assert "in the chunks at offsets" in chunks.cover_problem(
        (2, 8, 8), boxes3 + [((1, 1, 1), (1, 1, 1))])


# -- item 6: a padded vocabulary ----------------------------------------------------------

def megatron_dcp(directory: Path, rows: int, args, vocab: int) -> torch.Tensor:
    """Megatron-Core GPT weights of the model with ``model.vocab_size = vocab``, its
    embedding and head stored with ``rows`` rows; ``common.pt`` with ``args`` (None: no
    args)."""
    m = model(f"model.vocab_size={vocab}")
    form = megatron.MegatronForm(m, {megatron.EMBED}, {})
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in form.expected(model_shapes(m)).items()}
    for key in (megatron.EMBED, megatron.HEAD):
        state[key] = torch.randn(rows, m.d_model, generator=g)
    save(directory, state)
    torch.save({"iteration": 0, **({"args": args} if args else {})}, directory / "common.pt")
    return state[megatron.EMBED]


PADDED = Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)


@pytest.mark.parametrize("rows, args, vocab, words", [
    (259, PADDED, 128, "padded by its writer's rule: 256)"),
    (259, None, 128, "rule: 128, 256 or 512)"),
    (384, None, 200, "rule: 256 or 512)"),
    (512, PADDED, 200, "tensor_model_parallel_size 2"),
])
def test_padding_beyond_the_writers_rule_is_refused(tmp_path, capsys, rows, args, vocab,
                                                     words):
    """c58ae28 took any larger vocabulary and dropped the rows past the config's (259 rows
    under vocab_size 128: 131 rows cut, exit 0)."""
    megatron_dcp(tmp_path / "d", rows, args, vocab)
    err = refused(capsys, *import_args(tmp_path / "d", tmp_path / "out.h5",
                                       f"model.vocab_size={vocab}"))
    assert f"{megatron.EMBED} ({rows}, 32)" in err and f"({vocab}, 32)" in err, err
    assert words in err and "make_vocab_size_divisible_by 128" in err, err


def test_padding_rule_reads_the_args_as_a_namespace_or_a_dict():
    m = model("model.vocab_size=200")
    as_dict = {"make_vocab_size_divisible_by": 64, "tensor_model_parallel_size": 4}
    assert megatron.vocab_padding(m, {"args": as_dict}).rows == {256}
    assert megatron.vocab_padding(m, {"args": PADDED}).rows == {256}
    assert megatron.vocab_padding(m, {}).rows == {256, 512}
    with pytest.raises(hf_map.InterchangeError,
                       match="tensor_model_parallel_size.* not (a|positive)"):
        megatron.vocab_padding(m, {"args": {"tensor_model_parallel_size": "2"}})


@pytest.mark.parametrize("rows, args", [(256, PADDED), (512, None), (200, None)])
def test_padding_by_the_writers_rule_is_cut(tmp_path, capsys, rows, args):
    embed = megatron_dcp(tmp_path / "d", rows, args, 200)
    rc, out, err = cli(capsys, *import_args(tmp_path / "d", tmp_path / "t.h5",
                                           "model.vocab_size=200"))
    assert rc == 0, err
    with h5py.File(tmp_path / "t.h5") as f:
        assert np.array_equal(f["model/embed"][...], embed[:200].numpy())


# -- item 7: an import never writes over anything -----------------------------------------

def hf_directory(directory: Path, shards: int = 1, where=None) -> Path:
    """A Hugging Face Llama of the model: config.json, safetensors (``shards`` files and an
    index; ``where(name)`` is the path the index gives a shard)."""
    m = model()
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_map.hf_config(m, 64, "float32", {})))
    shapes = model_shapes(m)
    g = torch.Generator().manual_seed(0)
    tensors = {e.key: torch.randn(shapes[e.name], generator=g) for e in hf_map.entries(m)}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    keys, weight_map = list(tensors), {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: tensors[key] for key in keys[k::shards]}
        save_file(part, str(directory / name))
        weight_map.update({key: (where or str)(name) for key in part})
    (directory / hf_map.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return directory


def source(tmp_path: Path, kind: str) -> tuple:
    if kind == "hf":
        return ("import", hf_directory(tmp_path / "hf"))
    titan_dcp(tmp_path / "d")
    return ("import", "--format", "dcp", tmp_path / "d", "--config", TINY,
            *[a for s in SETS for a in ("--set", s)])


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_import_refuses_a_destination_that_holds_anything(tmp_path, capsys, kind):
    """A run's checkpoint directory (step file and `latest`), an existing .h5 and a file
    where a directory is meant: each refused and left as it was."""
    args = source(tmp_path, kind)
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_00000000.h5").write_bytes(b"the run's own")
    (run / "latest").write_text("step_00000000.h5\n")
    err = refused(capsys, *args, "--out", run)
    assert str(run) in err and "not empty" in err and "new directory" in err
    assert (run / "step_00000000.h5").read_bytes() == b"the run's own"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_00000000.h5"]
    for target in (run / "step_00000000.h5", run / "latest"):
        err = refused(capsys, *args, "--out", target)
        assert str(target) in err and "new" in err
    assert (run / "latest").read_text() == "step_00000000.h5\n"


# -- item 8: paths in a checkpoint's own metadata -----------------------------------------

@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_dcp_storage_paths_out_of_the_directory_are_refused(tmp_path, capsys, how):
    """The files the records name are real and readable: c58ae28 read them."""
    titan_dcp(tmp_path / "d")
    (index, record) = last_record(tmp_path / "d")
    name = record.relative_path
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(tmp_path / "d" / name, outside)
    if how == "symlink":
        (tmp_path / "d" / name).unlink()
        os.symlink(outside, tmp_path / "d" / name)
        path = name
    else:
        path = str(outside) if how == "absolute" else "../elsewhere.distcp"

        def repoint(meta):
            for info in meta.storage_data.values():
                info.relative_path = path
        rewrite(tmp_path / "d", repoint)
    err = refused(capsys, *import_args(tmp_path / "d", tmp_path / "out.h5"))
    assert repr(path) in err and "outside" in err and f"{tmp_path / 'd'}" in err, err
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_hf_index_paths_out_of_the_directory_are_refused(tmp_path, capsys, how):
    elsewhere = hf_directory(tmp_path / "elsewhere", shards=2)
    where = {"absolute": lambda n: str(elsewhere / n), "dotdot": lambda n: f"../elsewhere/{n}"}
    hf = hf_directory(tmp_path / "hf", shards=2, where=where[how])
    err = refused(capsys, "import", hf, "--out", tmp_path / "out.h5")
    assert "weight_map[" in err and "outside" in err and str(hf) in err, err
    assert not (tmp_path / "out.h5").exists()


def test_hf_hub_cache_links_into_its_blobs_are_followed(tmp_path, capsys):
    """The hub cache's snapshots/REV holds links to ../../blobs: those are the model's."""
    repo = tmp_path / "models--tiny"
    snap = hf_directory(repo / "snapshots" / "abc", shards=2)
    (repo / "blobs").mkdir()
    for shard in snap.glob("*.safetensors"):
        shutil.move(shard, repo / "blobs" / shard.name)
        os.symlink(Path("../../blobs") / shard.name, shard)
    assert cli(capsys, "import", snap, "--out", tmp_path / "t.h5")[0] == 0


def test_records_sharing_bytes_and_chunks_of_another_dtype_are_refused(tmp_path, capsys):
    """Found by the fuzz campaign: a storage record moved onto another entry's bytes (of the
    same size) imported that entry's values; metadata stating float16 for float32 bytes
    imported them rounded. Both are refused, naming the entries."""
    titan_dcp(tmp_path / "a")

    def onto_another(meta):
        first, second = sorted(meta.storage_data, key=lambda i: i.fqn)[:2]
        meta.storage_data[second].offset = meta.storage_data[first].offset
        meta.storage_data[second].relative_path = meta.storage_data[first].relative_path

    rewrite(tmp_path / "a", onto_another)
    err = refused(capsys, *import_args(tmp_path / "a", tmp_path / "a.h5"))
    assert "inside" in err and not (tmp_path / "a.h5").exists()
    titan_dcp(tmp_path / "b")

    def half(meta):
        meta.state_dict_metadata[EMBED].properties.dtype = torch.float16

    rewrite(tmp_path / "b", half)
    err = refused(capsys, *import_args(tmp_path / "b", tmp_path / "b.h5"))
    assert "stored as torch.float32" in err and "float16" in err


def test_metadata_without_its_entries_and_huge_steps_are_refused(tmp_path, capsys):
    titan_dcp(tmp_path / "a")

    def strip(meta):
        del meta.__dict__["state_dict_metadata"]

    rewrite(tmp_path / "a", strip)
    assert "without DCP Metadata's entries" in refused(
        capsys, *import_args(tmp_path / "a", tmp_path / "a.h5"))
    from hpctrain.interchange.forms import count

    assert count(7, "s") == 7 and count(torch.tensor(3), "s") == 3
    for bad in (2**70, float("inf"), -1, 2.5, True, "7"):
        with pytest.raises(hf_map.InterchangeError, match="not a step count"):
            count(bad, "common.pt's training step")
