"""Tokenizers (byte-level BPE training, any tokenizer.json), the token dtype, what a prepared
file records about its tokenizer, and the vocabulary check before a run (no MPI)."""

import hashlib
import json

import h5py
import numpy as np
import pytest

from hpctrain.data.dataset import DataError, fit_problems, load_tokens, summarize
from hpctrain.data.prepare import Source, prepare, text_source
from hpctrain.data.tokenizer import (
    TokenizerError,
    byte_level,
    from_json,
    load,
    token_dtype,
    tokenizer_json,
    train_bpe,
)

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # note {i}\n".encode() * (1 + i % 5)
        for i in range(60)]


def test_dtype_follows_the_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32
    assert byte_level().dtype == np.uint8


def test_bpe_training_is_deterministic_and_round_trips():
    a, b = train_bpe(DOCS, 300), train_bpe(list(DOCS), 300)
    assert a == b
    tok = from_json(a, "t")
    assert tok.vocab_size == 300 and tok.hash == hashlib.sha256(a.encode()).hexdigest()
    (ids,) = tok.encode([DOCS[3]])
    assert ids.dtype == np.uint16 and ids[0] == 0  # <|endoftext|> opens a document
    assert len(ids) < len(DOCS[3]) / 2  # merges were learnt
    from tokenizers import Tokenizer

    assert Tokenizer.from_str(a).decode(ids.tolist()) == DOCS[3].decode()


def _wordpiece(n_words: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(n_words)}}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def _unigram() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    pieces = [("<unk>", 0.0)] + [(c, -1.0) for c in "abcdefghij "] + [("ab", -0.5),
                                                                        ("cde", -0.4)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok.to_str()


def _prepare_with(tmp_path, text: str, docs: list[bytes], name: str = "d.h5"):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i, d in enumerate(docs):
        (src / f"{i:03d}.txt").write_bytes(d)
    tj = tmp_path / "tokenizer.json"
    tj.write_text(text)
    out = tmp_path / name
    attrs = prepare(text_source([str(src)]), load(str(tj)), str(out), 0.2)
    return str(out), attrs


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "bpe"])
def test_any_tokenizer_json_prepares_and_is_recorded(tmp_path, kind):
    text = {"wordpiece": lambda: _wordpiece(40), "unigram": _unigram,
            "bpe": lambda: train_bpe(DOCS, 280)}[kind]()
    docs = ([" ".join(f"w{(i * 7 + j) % 40}" for j in range(30)).encode() for i in range(25)]
            if kind == "wordpiece" else
            [("abcde ab cde j " * (i + 1)).encode() for i in range(25)]
            if kind == "unigram" else DOCS)
    path, attrs = _prepare_with(tmp_path, text, docs)
    tok = from_json(text, "t")
    with h5py.File(path, "r") as f:
        train, val = f["train/tokens"][...], f["val/tokens"][...]
        assert train.dtype == np.uint16 and val.dtype == np.uint16
        assert f.attrs["tokenizer_hash"] == hashlib.sha256(text.encode()).hexdigest()
        assert f.attrs["vocab_size"] == tok.vocab_size
        assert f.attrs["max_token_id"] == max(int(train.max()), int(val.max(initial=0)))
        starts = f["train/doc_starts"][...]
        assert starts[0] == 0 and (np.diff(starts) > 0).all()
        assert f.attrs["train_documents"] + f.attrs["val_documents"] == len(docs)
    assert tokenizer_json(path) == text
    assert json.loads(tokenizer_json(path))["model"]["type"].lower() == kind
    s = summarize(path)
    assert (s.vocab_size, s.tokenizer) == (tok.vocab_size, tok.name)
    if kind == "wordpiece":  # unknown words would be [UNK]: every id came from the vocabulary
        assert 0 not in train
    assert load_tokens(path).lineage["content_hash"] == attrs["content_hash"]


def test_vocabulary_must_cover_the_tokenizer(tmp_path):
    """A model narrower than the tokenizer is refused even when this data's ids fit: naming
    the tokenizer, its size and the key."""
    path, attrs = _prepare_with(tmp_path, _wordpiece(1000), [b"w1 w2 w3 " * 50] * 3)
    s = summarize(path)
    assert s.max_id == 4 and s.vocab_size == 1001
    (msg,) = fit_problems(s, 256, 16, 0)
    assert f"tokenizer {attrs['tokenizer']} has 1001 ids" in msg
    assert "model.vocab_size must be >= 1001, got model.vocab_size=256" in msg
    assert fit_problems(s, 1001, 16, 0) == []


def test_a_vocabulary_past_65536_ids_is_stored_as_uint32(tmp_path):
    docs = [f"w{i} w69999 w65536 w3".encode() for i in range(10)]
    path, _ = _prepare_with(tmp_path, _wordpiece(70000), docs)
    with h5py.File(path, "r") as f:
        assert f["train/tokens"].dtype == np.uint32 and f.attrs["max_token_id"] == 70000


def test_the_embedded_corpus_with_a_tokenizer(tmp_path):
    tj = tmp_path / "tok.json"
    tj.write_text(train_bpe(DOCS, 300))
    s = summarize("", 0.1, 0.05, str(tj))
    train = load_tokens("", "train", 0.1, 0.05, str(tj))
    val = load_tokens("", "val", 0.1, 0.05, str(tj))
    assert train.tokens.dtype == np.uint16 and s.vocab_size == 300
    assert s.tokens == {"train": len(train.tokens), "val": len(val.tokens)}
    assert s.max_id == max(int(train.tokens.max()), int(val.tokens.max()))
    assert len(train.tokens) < summarize("", 0.1, 0.05).tokens["train"]  # fewer than bytes
    assert train.lineage["tokenizer_hash"] == load(str(tj)).hash
    assert train.lineage["content_hash"] != load_tokens("", "train", 0.1).lineage["content_hash"]
    with pytest.raises(DataError, match="data.tokenizer: tokenizer .*none.json does not exist"):
        summarize("", 0.1, 0.05, str(tmp_path / "none.json"))


def test_foreign_tokenizer_files_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"type": "Nope"}}')
    for path, why in [(bad, "not a tokenizer.json"), (tmp_path / "no.json", "does not exist"),
                      (tmp_path, "is not a file")]:
        with pytest.raises(TokenizerError) as e:
            load(str(path))
        assert why in str(e.value) and str(path) in str(e.value)
        assert "\n" not in str(e.value)


def test_a_document_that_cannot_be_read_fails_every_rank_alike(tmp_path):
    def broken(i):
        raise DataError(f"doc{i} cannot be read")

    src = Source("text", ["a", "b"], np.array([5, 5]), broken)
    with pytest.raises(DataError, match="doc0 cannot be read"):
        prepare(src, byte_level(), str(tmp_path / "x.h5"))
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    """``hpctrain tokenizer train`` (no MPI): exit 2, one line, nothing written."""
    from hpctrain.__main__ import main

    (tmp_path / "a.txt").write_text("text\n")
    for args, says in [([], "give text FILES or --embedded"),
                       ([str(tmp_path / "a.txt"), "--embedded"], "give text FILES or --embedded"),
                       ([str(tmp_path / "none")], "neither a file nor a directory"),
                       ([str(tmp_path / "a.txt"), "--vocab-size", "100"],
                        "--vocab-size=100 must be at least 257"),
                       (["--embedded", "--corpus-mb", "0"], "--corpus-mb=0.0 must be > 0")]:
        args = args if "--vocab-size" in args else [*args, "--vocab-size", "300"]
        assert main(["tokenizer", "train", *args, "--out", str(tmp_path / "t.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hpctrain tokenizer: ") and says in err, err
        assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_tokenizer_train_leaves_out_binary_and_hidden_files(tmp_path, capsys):
    """As ``prepare`` does, ``tokenizer train`` trains on text only: a binary file (ELF) and a
    hidden directory are counted, not learned from; with only binary files it refuses."""
    from hpctrain.__main__ import main
    from hpctrain.data.tokenizer import load

    src = tmp_path / "src"
    (src / ".git").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / "a.txt").write_text("hello world " * 50)
    (src / "tool").write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    out = tmp_path / "t.json"
    assert main(["tokenizer", "train", str(src), "--vocab-size", "300", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "skipped 1 binary files, 1 hidden entries" in said and "from 1 documents" in said
    ids = load(str(out)).encode([b"ref: refs/heads"])[0]
    assert len(ids) > 1  # nothing of the hidden file was merged
    (src / "a.txt").unlink()
    assert main(["tokenizer", "train", str(src), "--vocab-size", "300",
                 "--out", str(tmp_path / "u.json")]) == 2
    assert "every file is binary" in capsys.readouterr().err
    assert not (tmp_path / "u.json").exists()


def test_prepare_argument_rules():
    from types import SimpleNamespace

    from hpctrain.cli.prepare import problems

    base = dict(val_fraction=0.05, corpus_mb=2.0, form=None, sources=[], eot=50256)
    assert problems(SimpleNamespace(**base)) is None
    for change, says in [({"form": "nanogpt"}, "reads one corpus"),
                         ({"form": "megatron", "sources": ["a", "b"]}, "got 2"),
                         ({"val_fraction": 1.0}, "--val-fraction=1.0 must be in [0, 1)"),
                         ({"eot": -1}, "--eot=-1 must be a token id")]:
        assert says in problems(SimpleNamespace(**{**base, **change}))


def test_one_load_for_a_file_its_directory_and_the_text_a_data_file_carries(tmp_path):
    """``load`` takes a tokenizer.json, the directory holding it, or the text a prepared
    file carries (as ``find`` returns it): the same Tokenizer; ``library()`` is the library's
    object for it, and byte-level tokens have one too (id = byte)."""
    from hpctrain.data.tokenizer import TokenizerText

    text = train_bpe(DOCS, 300)
    (tmp_path / "tokenizer.json").write_text(text)
    by_file, by_dir = load(str(tmp_path / "tokenizer.json")), load(str(tmp_path))
    by_text = load(TokenizerText(text))
    assert by_file == by_dir == by_text
    assert by_file.hash == hashlib.sha256(text.encode()).hexdigest()
    (ids,) = by_file.encode([DOCS[0]])
    assert by_file.library().encode(DOCS[0].decode()).ids == ids.tolist()
    assert byte_level().library().encode("aé").ids == list("aé".encode())
    data = tmp_path / "d.h5"
    with h5py.File(data, "w"):
        pass
    assert tokenizer_json(str(data)) is None  # byte-level data carries none
    with pytest.raises(TokenizerError, match="no readable tokenizer.json"):
        tokenizer_json(str(tmp_path / "tokenizer.json"))  # not HDF5
