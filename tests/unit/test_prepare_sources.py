"""What ``hpctrain prepare`` reads from a directory (hidden and binary files are skipped and
counted) and what ``hpctrain inspect`` shows of the file it writes (no MPI: one process)."""

import argparse
import gzip
import hashlib

import h5py
import numpy as np
from fakes import OneRank

from hpctrain.cli import inspect as inspect_cli
from hpctrain.cli import prepare as prepare_cli
from hpctrain.data.prepare import prepare, text_source
from hpctrain.data.tokenizer import byte_level, load, train_bpe

ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(120)


def _corpus(tmp_path):
    """Two text documents beside a .git directory, a .DS_Store, an executable and a .gz."""
    src = tmp_path / "src"
    (src / ".git" / "objects").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / ".git" / "objects" / "ab").write_bytes(b"x\x01" + bytes(40))
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(60))
    (src / "notes.txt").write_text("a line of notes\n" * 30)
    (src / "sub").mkdir()
    (src / "sub" / "code.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (src / "sub" / "tool").write_bytes(ELF)
    (src / "sub" / "more.txt.gz").write_bytes(gzip.compress(b"compressed text\n" * 40))
    return src


def test_hidden_and_binary_files_are_skipped_and_counted(tmp_path):
    src = text_source([str(_corpus(tmp_path))])
    assert all("/." not in name for name in src.names), src.names
    assert src.hidden == 2  # .git/ (not entered) and .DS_Store
    attrs = prepare(src, byte_level(), str(tmp_path / "d.h5"), 0.0)
    assert attrs["documents"] == 2 and attrs["skipped_binary"] == 2, attrs
    assert attrs["skipped_hidden"] == 2
    with h5py.File(tmp_path / "d.h5", "r") as f:
        tokens = f["train/tokens"][...].tobytes()
    assert b"ELF" not in tokens and b"notes" in tokens and b"return x" in tokens


def test_a_named_hidden_file_is_read(tmp_path):
    (tmp_path / ".profile").write_text("export A=1\n")
    src = text_source([str(tmp_path / ".profile")])
    assert src.names == [str(tmp_path / ".profile")] and src.hidden == 0


def test_prepare_says_what_it_skipped(tmp_path, monkeypatch, capsys):
    import hpctrain.comm

    monkeypatch.setenv("HPCTRAIN_PREPARE_SERIAL", "1")
    monkeypatch.setattr(hpctrain.comm, "world", OneRank)
    p = argparse.ArgumentParser()
    prepare_cli.add_arguments(p)
    args = p.parse_args([str(_corpus(tmp_path)), "--out", str(tmp_path / "d.h5")])
    assert prepare_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out
    (line,) = [x for x in out.splitlines() if x.startswith("skipped ")]
    assert "2 hidden" in line and "2 binary" in line, line


def test_inspect_shows_a_data_file(tmp_path, capsys):
    docs = [f"document {i}: " .encode() + b"some words here " * (i + 3) for i in range(30)]
    (tmp_path / "tok.json").write_text(train_bpe(docs, 300))
    (tmp_path / "src").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "src" / f"{i:02d}.txt").write_bytes(d)
    tok = load(str(tmp_path / "tok.json"))
    path = tmp_path / "d.h5"
    attrs = prepare(text_source([str(tmp_path / "src")]), tok, str(path), 0.2)
    p = argparse.ArgumentParser()
    inspect_cli.add_arguments(p)
    assert inspect_cli.run(p.parse_args([str(path)])) == 0
    out = capsys.readouterr().out
    assert "checkpoint" not in out.lower() and out.startswith(f"data file {path}"), out
    with h5py.File(path, "r") as f:
        for split in ("train", "val"):
            n, d = f[f"{split}/tokens"].shape[0], f[f"{split}/doc_starts"].shape[0]
            (line,) = [x for x in out.splitlines() if x.split()[:1] == [split]]
            assert f"{n} tokens" in line and f"{d} documents" in line, line
    digest = hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest()
    assert attrs["tokenizer_hash"] == digest and digest in out and attrs["tokenizer"] in out
    assert attrs["content_hash"] in out and "vocab_size" in out
    assert inspect_cli.run(p.parse_args([str(path), "--json"])) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "data" and info["splits"]["val"]["documents"] == attrs["val_documents"]
    assert info["attrs"]["tokenizer_hash"] == digest
    assert np.isfinite(info["splits"]["train"]["tokens"])
    assert inspect_cli.run(p.parse_args([str(path), "--verify"])) == 0
    assert "verify ok" in capsys.readouterr().out
    with h5py.File(path, "a") as f:
        f["val/tokens"][0] = f["val/tokens"][0] + 1
    assert inspect_cli.run(p.parse_args([str(path), "--verify"])) == 1
    assert "VERIFY FAILED: content_hash" in capsys.readouterr().out
