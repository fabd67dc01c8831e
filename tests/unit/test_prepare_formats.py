"""``hpctrain prepare``'s readers (no MPI): JSONL plain, .gz and .zst, Parquet written by
pyarrow, globs and directories of shards in one global order, plain JSONL cut into byte
ranges anywhere, malformed records named by file and line (refused, or skipped and
counted), the counts per input, and the refusal through the command."""

import argparse
import json

import h5py
import pytest
from corpus_files import write_jsonl, write_parquet
from fakes import OneRank
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.cli import inspect as inspect_cli
from hpctrain.cli import prepare as prepare_cli
from hpctrain.data import documents
from hpctrain.data.dataset import DataError
from hpctrain.data.prepare import prepare, text_source
from hpctrain.data.tokenizer import byte_level

TEXTS = [f"document {i}: " + "words and more words, é ü 漢字 " * (i % 7 + 1) for i in range(40)]


def _docs(paths, key="text", chunk=0):
    src = text_source([str(p) for p in paths], key=key, chunk=chunk)
    return [d for u in range(len(src.names)) for d in src.read(u)], src


def _tokens(path):
    with h5py.File(path, "r") as f:
        return {n: f[n][...].tobytes() for n in ("train/tokens", "val/tokens",
                                                 "train/doc_starts", "val/doc_starts")}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_every_format_gives_the_documents_in_order(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(path, TEXTS, "body")
    docs, src = _docs([path], key="body")
    assert docs == [t.encode() for t in TEXTS]
    if suffix == ".parquet":
        assert len(src.names) == 14  # one unit per row group of 3 rows
    attrs = prepare(src, byte_level(), str(tmp_path / "d.h5"), 0.2)
    (tmp_path / "t").mkdir()
    for i, t in enumerate(TEXTS):  # the same documents as text files
        (tmp_path / "t" / f"{i:02d}.txt").write_text(t)
    prepare(text_source([str(tmp_path / "t")]), byte_level(), str(tmp_path / "e.h5"), 0.2)
    assert _tokens(tmp_path / "d.h5") == _tokens(tmp_path / "e.h5")
    assert attrs["documents"] == 40 and attrs["skipped_records"] == 0


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
                     max_size=25), chunk=st.integers(1, 200),
       blanks=st.sets(st.integers(0, 25), max_size=4))
def test_plain_jsonl_cut_into_byte_ranges_anywhere_reads_every_record_once(
        tmp_path_factory, texts, chunk, blanks):
    path = tmp_path_factory.mktemp("j") / "c.jsonl"
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    for b in sorted(blanks, reverse=True):
        lines.insert(min(b, len(lines)), b"\n")
    path.write_bytes(b"".join(lines))
    docs, src = _docs([path], chunk=chunk)
    assert docs == [t.encode() for t in texts]
    assert len(src.names) == max(1, -(-path.stat().st_size // chunk))


def test_globs_and_directories_in_one_order_with_their_inputs(tmp_path):
    (tmp_path / "shards" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "shards" / "b.jsonl.gz", ["b0", "b1"])
    write_parquet(tmp_path / "shards" / "a.parquet", ["a0", "a1", "a2", "a3"])
    write_jsonl(tmp_path / "shards" / "sub" / "c.jsonl.zst", ["c0"])
    (tmp_path / "shards" / "sub" / "d.txt").write_text("d0")
    (tmp_path / "shards" / ".hidden.jsonl").write_text('{"text": "no"}\n')
    write_jsonl(tmp_path / "x1.jsonl", ["x1"])
    write_jsonl(tmp_path / "x0.jsonl", ["x0"])
    docs, src = _docs([tmp_path / "shards", tmp_path / "x*.jsonl"])
    assert docs == [b"a0", b"a1", b"a2", b"a3", b"b0", b"b1", b"c0", b"d0", b"x0", b"x1"]
    assert src.source.tolist() == [0, 0, 0, 0, 0, 1, 1] and src.hidden == 1
    attrs = prepare(src, byte_level(), str(tmp_path / "d.h5"), 0.0)
    counts = json.loads(attrs["source_counts"])
    assert [(c["source"], c["train_documents"], c["train_tokens"]) for c in counts] == \
        [(str(tmp_path / "shards"), 8, 16), (str(tmp_path / "x*.jsonl"), 2, 4)]
    with pytest.raises(DataError, match="nothing.jsonl matches no file"):
        text_source([str(tmp_path / "nothing*" / "nothing.jsonl")])


BAD = {3: b"{not json\n", 5: b'{"other": "x"}\n', 6: b'{"text": 7}\n',
       8: b'{"text": "caf\xe9"}\n', 9: b"[1, 2]\n"}
WHY = {3: "bad JSON", 5: "no field 'text'", 6: "field 'text' is int, not a string",
       8: "not UTF-8", 9: "no field 'text'"}


@pytest.mark.parametrize("suffix, chunk", [(".jsonl", 0), (".jsonl", 37), (".jsonl.gz", 0)])
def test_malformed_records_are_named_by_file_and_line(tmp_path, suffix, chunk):
    path = tmp_path / f"c{suffix}"
    write_jsonl(path, TEXTS[:10], lines=BAD)
    docs, _ = _docs([path], chunk=chunk)
    bad = [d for d in docs if isinstance(d, documents.Bad)]
    assert [b.where for b in bad] == [f"{path}:{n}" for n in BAD]
    assert all(WHY[n] in b.why for n, b in zip(BAD, bad)), bad
    assert len(docs) - len(bad) == 5


def test_parquet_nulls_and_a_missing_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x", None, "y", "z", None])
    docs, _ = _docs([tmp_path / "a.parquet"])
    assert docs[0] == b"x" and docs[2:4] == [b"y", b"z"]
    assert [d.where for d in docs if isinstance(d, documents.Bad)] == \
        [f"{tmp_path / 'a.parquet'}: record 2", f"{tmp_path / 'a.parquet'}: record 5"]
    write_parquet(tmp_path / "b.parquet", ["x"] * 7, column="content")
    docs, _ = _docs([tmp_path / "b.parquet"])
    (bad,) = docs  # said once, by the first row group's reader
    assert bad.file and "no column 'text' (columns: content, id" in bad.why


def test_bad_records_are_refused_or_skipped_and_counted(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", TEXTS[:10], lines=BAD)
    write_parquet(tmp_path / "p.parquet", ["x"] * 4, column="content")
    (tmp_path / "t.txt").write_text("a text file")
    paths = [str(tmp_path / n) for n in ("c.jsonl", "p.parquet", "t.txt")]
    with pytest.raises(DataError, match=r"c.jsonl:3: bad JSON .*--skip-bad-records"):
        prepare(text_source(paths), byte_level(), str(tmp_path / "d.h5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "p.parquet", "t.txt"]
    attrs = prepare(text_source(paths), byte_level(), str(tmp_path / "d.h5"), skip_bad=True)
    assert attrs["skipped_records"] == 5 and attrs["skipped_files"] == 1
    assert attrs["documents"] == 6
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert f.attrs["skipped_records"] == 5 and f.attrs["skipped_files"] == 1
        assert f.attrs["train_tokens"] + f.attrs["val_tokens"] == sum(
            len(t.encode()) for i, t in enumerate(TEXTS[:10]) if i + 1 not in BAD) + 11


def _cli(tmp_path, argv):
    p = argparse.ArgumentParser()
    prepare_cli.add_arguments(p)
    return prepare_cli.run(p.parse_args([str(a) for a in argv]))


def test_the_command_refuses_a_bad_record_in_one_line_and_keeps_the_old_file(
        tmp_path, monkeypatch, capsys):
    import hpctrain.comm

    monkeypatch.setenv("HPCTRAIN_PREPARE_SERIAL", "1")
    monkeypatch.setattr(hpctrain.comm, "world", OneRank)
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "c.jsonl.zst", TEXTS[:10], lines={7: b'{"text": null}\n'})
    out = tmp_path / "d.h5"
    out.write_bytes(b"the previous data file")
    assert _cli(tmp_path, [tmp_path / "in", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpctrain prepare: "), err
    assert f"{tmp_path / 'in' / 'c.jsonl.zst'}:7: field 'text' is NoneType" in err, err
    assert out.read_bytes() == b"the previous data file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5", "in"]
    write_parquet(tmp_path / "p.parquet", TEXTS[:6])
    assert _cli(tmp_path, [tmp_path / "in", tmp_path / "p.parquet", "--skip-bad-records",
                           "--out", out]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"wrote {out}: 15 documents"), said
    assert said[1].startswith(f"  {tmp_path / 'in'}: ") and "documents" in said[1], said
    assert said[2].startswith(f"  {tmp_path / 'p.parquet'}: "), said
    assert said[-1].startswith("skipped 1 bad records and 0 files"), said
    p = argparse.ArgumentParser()
    inspect_cli.add_arguments(p)
    assert inspect_cli.run(p.parse_args([str(out)])) == 0
    shown = capsys.readouterr().out
    assert f"source {tmp_path / 'p.parquet'}" in shown, shown
    assert ["skipped_records", "1"] in [line.split() for line in shown.splitlines()], shown


def test_counts_of_many_inputs_stay_valid_json_in_an_attribute():
    import numpy as np

    from hpctrain.data.prepare import source_counts

    inputs = [f"shards/part-{i:06d}-of-a-long-name.jsonl.zst" for i in range(3000)]
    per = np.arange(3000 * 4).reshape(3000, 4)
    rows = json.loads(source_counts(inputs, per))
    assert len(json.dumps(rows)) <= 60000 and rows[-1]["source"].endswith("more inputs)")
    assert sum(r["train_documents"] for r in rows) == int(per[:, 2].sum())
    assert [r["source"] for r in rows[:-1]] == inputs[:len(rows) - 1]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_a_damaged_shard_is_refused_even_when_skipping(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(path, TEXTS)
    path.write_bytes(path.read_bytes()[:-40] if suffix != ".parquet" else b"PAR1 damaged")
    with pytest.raises(DataError, match=f"{path}") as e:
        src = text_source([str(path)])
        prepare(src, byte_level(), str(tmp_path / "d.h5"), skip_bad=True)
    assert "\n" not in str(e.value) and not (tmp_path / "d.h5").exists()
