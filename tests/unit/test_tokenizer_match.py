"""The tokenizer a checkpoint was trained with, checked wherever one is found for it
(docs/models.md): export, generate and init_from refuse a retrained or missing tokenizer
with one message naming the recorded hash, where it came from, the file found and its hash;
byte-level models need no file. Checkpoints are written in the run's format by the importer's
writer (no MPI), with the data lineage the embedded corpus records."""

import dataclasses
import json
import os
import shutil

import h5py
import pytest
import torch

from hpctrain.config import Config, ModelConfig
from hpctrain.data import tokenizer, tokenizer_match
from hpctrain.data.dataset import load_tokens
from hpctrain.interchange import generation, hf_import, init_from

DOCS = [b"def f(x):\n    return x + 1\n" * 20, b"class A:\n    pass\n" * 30,
        b"import os\nprint(os.getcwd())\n" * 10]


def bpe(path, vocab):
    path.write_text(tokenizer.train_bpe(DOCS * vocab, vocab))
    return tokenizer.load(str(path))


def checkpoint(out, lineage_data: dict, vocab: int = 320):
    """A committed checkpoint of a tiny llama whose data lineage is ``lineage_data``."""
    m = ModelConfig(arch="llama", vocab_size=vocab, d_model=16, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    tensors = {n: torch.randn(p.shape, dtype=p.dtype).mul_(0.02).numpy()
               for n, p in generation.whole_model(m).named_parameters()}
    cfg = dataclasses.replace(Config(), model=m)
    return hf_import.write_checkpoint(out, cfg, hf_import.file_arrays(tensors, m.dtype),
                                      {"data": lineage_data})


@pytest.fixture
def trained(tmp_path):
    """(checkpoint, tokenizer path, its hash): trained on the embedded corpus with a BPE."""
    tok = bpe(tmp_path / "tokenizer.json", 300)
    lineage = load_tokens("", corpus_mb=0.01, tokenizer=str(tmp_path / "tokenizer.json")).lineage
    assert lineage["tokenizer_hash"] == tok.hash
    return checkpoint(tmp_path / "ckpt", lineage), tmp_path / "tokenizer.json", tok.hash


def test_a_retrained_tokenizer_is_refused_by_export_and_generate(trained, tmp_path, cli):
    ckpt, path, good = trained
    new = bpe(path, 290)  # retrained to the same path
    rc, _, err = cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf")
    assert rc == 2 and good in err and new.hash in err and str(path) in err, err
    assert "--tokenizer" in err and not (tmp_path / "hf" / "tokenizer.json").exists()
    rc, out, err = cli("generate", ckpt, "--tokens", "2")
    assert rc == 2 and good in err and new.hash in err and out == "", err
    rc, _, err = cli("generate", ckpt, "--tokens", "2", "--tokenizer", path)
    assert rc == 2 and good in err and new.hash in err, err


def test_a_missing_tokenizer_is_refused_not_replaced_by_bytes(trained, tmp_path, cli):
    ckpt, path, good = trained
    shutil.move(path, tmp_path / "elsewhere.json")
    rc, out, err = cli("generate", ckpt, "--tokens", "2")
    assert rc == 2 and good in err and str(path) in err and out == "", err
    rc, _, err = cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf")
    assert rc == 2 and good in err, err
    # pointed at the right file, both work
    rc, out, err = cli("generate", ckpt, "--tokens", "2", "--tokenizer",
                       tmp_path / "elsewhere.json")
    assert rc == 0, err
    rc, _, err = cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf", "--tokenizer",
                     tmp_path / "elsewhere.json")
    assert rc == 0, err
    saved = tokenizer.load(str(tmp_path / "hf" / "tokenizer.json")).library()
    assert saved.get_vocab() == tokenizer.load(str(tmp_path / "elsewhere.json")).library() \
        .get_vocab()


def test_byte_level_models_need_no_file_and_refuse_a_bpe(tmp_path, cli):
    ckpt = checkpoint(tmp_path / "ckpt", {"tokenizer": "bytes"}, vocab=256)
    assert cli("generate", ckpt, "--tokens", "2")[0] == 0
    assert cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf")[0] == 0
    tok = bpe(tmp_path / "tokenizer.json", 300)
    rc, _, err = cli("generate", ckpt, "--tokens", "2", "--tokenizer",
                     tmp_path / "tokenizer.json")
    assert rc == 2 and "byte-level" in err and tok.hash in err, err
    # the byte-level tokenizer.json an export writes is byte-level tokens too
    assert cli("generate", ckpt, "--tokens", "2", "--tokenizer", tmp_path / "hf")[0] == 0


def test_init_from_refuses_a_checkpoint_of_another_tokenizer(trained, tmp_path):
    ckpt, path, good = trained
    other = bpe(tmp_path / "other.json", 290)
    base = dataclasses.replace(Config(), model=ModelConfig(
        arch="llama", vocab_size=320, d_model=16, n_layers=1, n_heads=2))
    run = dataclasses.replace(base, checkpoint=dataclasses.replace(
        base.checkpoint, init_from=str(ckpt)))
    same = dataclasses.replace(run, data=dataclasses.replace(run.data, tokenizer=str(path)))
    assert init_from.problems(same) == []
    for data in (dataclasses.replace(run.data, tokenizer=str(tmp_path / "other.json")),
                 run.data):  # another BPE; byte-level ids
        (err,) = init_from.problems(dataclasses.replace(run, data=data))
        assert good in err and "tokenizer" in err, err
    assert other.hash in init_from.problems(dataclasses.replace(
        run, data=dataclasses.replace(run.data, tokenizer=str(tmp_path / "other.json"))))[0]
    for digest, refused in ((good, False), (other.hash, True)):  # a prepared file's record
        with h5py.File(tmp_path / "data.h5", "w") as f:
            f.attrs.update({"tokenizer": "hf:BPE:x", "tokenizer_hash": digest})
        problems = init_from.problems(dataclasses.replace(run, data=dataclasses.replace(
            run.data, path=str(tmp_path / "data.h5"))))
        assert bool(problems) == refused and (not refused or "data.h5" in problems[0])


def test_exported_files_follow_the_umask(tmp_path, cli):
    ckpt = checkpoint(tmp_path / "ckpt", {"tokenizer": "bytes"}, vocab=256)
    old = os.umask(0o022)
    try:
        assert cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf")[0] == 0
        assert cli("export", ckpt, "--format", "safetensors", tmp_path / "m.safetensors")[0] == 0
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "hf").iterdir()] + [tmp_path / "m.safetensors"]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


def test_the_lineage_of_an_import_names_its_tokenizer(tmp_path):
    """recorded() reads what import and the data record; a lineage without data: unknown."""
    assert tokenizer_match.recorded(json.dumps({"data": {"tokenizer": "bytes"}}))[0] == \
        tokenizer.BYTES
    assert tokenizer_match.recorded(json.dumps({"imported_from": "x"}))[0] is None
    assert tokenizer_match.recorded(json.dumps({"data": {"tokenizer": "hf:BPE:ab",
                                                   "tokenizer_hash": "ab" * 32}}))[0] == \
        "ab" * 32


def test_export_import_and_init_from_keep_the_tokenizer_hash(trained, tmp_path, cli):
    """The export ships the tokenizer's own text, the import records its hash, and
    init_from of that directory (or the import) checks it against the run's data."""
    ckpt, path, good = trained
    assert cli("export", ckpt, "--format", "hf", "--out", tmp_path / "hf")[0] == 0
    assert tokenizer.load(str(tmp_path / "hf")).hash == good
    assert cli("import", tmp_path / "hf", "--out", tmp_path / "imp.h5")[0] == 0
    assert cli("generate", tmp_path / "imp.h5", "--tokens", "2")[0] == 0
    bpe(tmp_path / "hf" / "tokenizer.json", 290)  # the directory's tokenizer replaced
    rc, _, err = cli("generate", tmp_path / "imp.h5", "--tokens", "2")
    assert rc == 2 and good in err and "tokenizer_file" in err, err
    m = ModelConfig(arch="llama", vocab_size=320, d_model=16, n_layers=1, n_heads=2)
    base = dataclasses.replace(Config(), model=m)
    for source in (tmp_path / "hf", tmp_path / "imp.h5"):
        run = dataclasses.replace(base, checkpoint=dataclasses.replace(
            base.checkpoint, init_from=str(source)))
        (err,) = init_from.problems(run)  # byte-level data
        assert "byte-level" in err and "tokenizer" in err, err
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, tokenizer=str(path)))
    assert init_from.problems(run) == []


def test_a_blend_is_tokenized_as_its_sources(tmp_path):
    """A blend's run (data.sources, no data.path) has its sources' tokenizer, for init_from's
    check and for a checkpoint's tokenizer lookup (generate, export): not byte-level."""
    import numpy as np

    from hpctrain.config import load
    from hpctrain.interchange.init_from import data_file

    text = '{"model": {"type": "BPE"}}'
    for name in ("a.h5", "b.h5"):
        with h5py.File(tmp_path / name, "w") as f:
            f.attrs["tokenizer"] = "tok.json"
            f.attrs["tokenizer_hash"] = "h1"
            f["tokenizer_json"] = np.frombuffer(text.encode(), np.uint8)
    sources = f'data.sources=[{{path = "{tmp_path}/a.h5", weight = 1}}, ' \
              f'{{path = "{tmp_path}/b.h5", weight = 1}}]'
    cfg = load(None, [sources])
    mine, what = tokenizer_match.of_data(data_file(cfg), cfg.data.tokenizer)
    assert mine == {"h1"} and "a.h5" in what  # the blend's, not byte-level
    config_toml = f'[data]\nsources = [{{path = "{tmp_path}/a.h5", weight = 1.0}}]\n'
    lineage = json.dumps({"data": {"source": f"blend of {tmp_path}/a.h5 x1",
                                   "tokenizer": "tok.json", "tokenizer_hash": "h1"}})
    found, why = tokenizer.find(lineage, config_toml)
    assert str(found) == text and "inside" in why and "a.h5" in why, (found, why)
