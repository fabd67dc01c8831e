"""The data commands as a user runs them: ``tokenizer train``, ``prepare --tokenizer`` in
parallel (the same file, byte for byte, at 1, 2 and 4 ranks), ``prepare --from nanogpt`` /
``--from megatron``, training on the embedded corpus with ``data.tokenizer``, and the
refusals (one message, exit 2, nothing written)."""

import hashlib
import json

import h5py
import numpy as np
import pytest
from corpus_files import EOT, write_jsonl, write_megatron, write_nanogpt, write_parquet
from launch import TINY, hpctrain, mpirun, train_args, train_cli
from token_files import write_token_file

pytestmark = pytest.mark.e2e


def _texts(tmp_path, n: int = 40):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        body = "".join(f"def step_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(i % 9))
        (src / f"doc{i:02d}.py").write_text(f"# document {i}\n" + body * 3)
    return src


def _refused(proc, command: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.stderr.count(f"hpctrain {command}: ") == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_tokenizer_train_is_deterministic(tmp_path):
    """The command's file equals the library's on the same documents in this process."""
    from hpctrain.data.tokenizer import train_bpe

    src = _texts(tmp_path)
    out = hpctrain(["tokenizer", "train", str(src), "--vocab-size", "320", "--out",
                    str(tmp_path / "new" / "a.json")])  # a directory not there yet
    assert "vocabulary 320 from 40 documents" in out.stdout
    again = train_bpe([p.read_bytes() for p in sorted(src.iterdir())], 320)
    assert (tmp_path / "new" / "a.json").read_text() == again
    assert json.loads(again)["model"]["type"] == "BPE"


def test_parallel_prepare_is_the_same_file_on_1_2_4_ranks(tmp_path):
    """Ranks tokenize disjoint documents and write one file together: its bytes do not
    depend on the number of ranks (nor on mpirun: one process gives the same)."""
    from hpctrain.data.tokenizer import train_bpe

    src = _texts(tmp_path)
    tok = tmp_path / "tok.json"
    tok.write_text(train_bpe([p.read_bytes() for p in sorted(src.iterdir())], 320))
    args = [str(src), "--tokenizer", str(tok), "--val-fraction", "0.2", "--out"]
    hpctrain(["prepare", *args, str(tmp_path / "d1.h5")])  # one process
    files = {1: (tmp_path / "d1.h5").read_bytes()}
    for n in (2, 4):
        out = tmp_path / f"d{n}.h5"
        proc = mpirun(n, ["-m", "hpctrain", "prepare", *args, str(out)], timeout=120)
        assert proc.stdout.count("wrote ") == 1 and "40 documents" in proc.stdout, proc.stdout
        files[n] = out.read_bytes()
    assert files[1] == files[2] == files[4]
    with h5py.File(tmp_path / "d4.h5", "r") as f:
        assert f["train/tokens"].dtype == np.uint16 and f["val/tokens"].shape[0] > 0
        assert f.attrs["tokenizer_hash"] == hashlib.sha256(tok.read_bytes()).hexdigest()
        assert f.attrs["vocab_size"] == 320 and f.attrs["val_documents"] > 0
        assert f["tokenizer_json"][...].tobytes() == tok.read_bytes()


def test_prepare_from_nanogpt_and_megatron_keeps_the_documents(tmp_path):
    """The same documents as a nanoGPT .bin (end-of-text after each) and as a Megatron
    indexed dataset (one sequence per document, its end-of-text included) give the same
    token datasets and document starts, also when the ranks write in turn (the writer for an
    h5py without MPI); a model narrower than the ids is refused."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 5000, rng.integers(5, 60)).tolist() for _ in range(120)]
    write_nanogpt(tmp_path / "c.bin", docs)
    write_megatron(tmp_path / "c", [[d + [EOT]] for d in docs])
    mpirun(2, ["-m", "hpctrain", "prepare", "--from", "nanogpt", str(tmp_path / "c.bin"),
               "--out", str(tmp_path / "n.h5")], timeout=120,
           extra_env={"HPCTRAIN_PREPARE_SERIAL": "1"})
    out = hpctrain(["prepare", "--from", "megatron", str(tmp_path / "c"), "--out",
                    str(tmp_path / "m.h5")])
    assert "120 documents" in out.stdout
    with h5py.File(tmp_path / "n.h5", "r") as n, h5py.File(tmp_path / "m.h5", "r") as m:
        for name in ("train/tokens", "val/tokens", "train/doc_starts", "val/doc_starts"):
            assert np.array_equal(n[name][...], m[name][...]), name
        assert n.attrs["content_hash"] == m.attrs["content_hash"]
        assert n.attrs["documents"] == 120 and n.attrs["max_token_id"] == EOT
        assert n.attrs["source_format"] == "nanogpt" and m.attrs["source_format"] == "megatron"
    from hpctrain.checks.inputs import data_problems
    from hpctrain.config import load

    (err,) = data_problems(load(TINY, [f'data.path="{tmp_path / "n.h5"}"']))
    assert "largest token id 50256" in err and "model.vocab_size >= 50257" in err


def test_training_on_the_embedded_corpus_with_a_tokenizer(tmp_path):
    """data.tokenizer: every rank tokenizes the embedded corpus alike; the lineage names the
    tokenizer; a model narrower than it is refused before anything is written."""
    from hpctrain.data.dataset import stdlib_documents
    from hpctrain.data.tokenizer import train_bpe

    tok = tmp_path / "tok.json"
    tok.write_text(train_bpe([d for _, d in stdlib_documents(2**19)], 512))
    run = train_cli(tmp_path / "run", 2, "topology.dp=2", f'data.tokenizer="{tok}"',
                    "model.vocab_size=512", "train.steps=2", "train.eval_every=2")
    assert len(run.losses) == 2 and run.losses[0] < 7.0  # ln 512 = 6.24 at the start
    data = json.loads((tmp_path / "run" / "lineage.json").read_text())["data"]
    assert data["tokenizer_hash"] == hashlib.sha256(tok.read_bytes()).hexdigest()
    assert data["vocab_size"] == 512 and data["tokenizer"].startswith("hf:BPE:")
    from hpctrain.checks.inputs import data_problems
    from hpctrain.config import load

    (err,) = data_problems(load(TINY, [f'data.tokenizer="{tok}"']))
    assert "needs model.vocab_size >= 512, got model.vocab_size=256" in err, err


def test_bad_prepare_inputs_are_one_message_on_every_rank(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    out = tmp_path / "x.h5"
    proc = mpirun(2, ["-m", "hpctrain", "prepare", str(tmp_path / "a.txt"), "--tokenizer",
                      str(tmp_path / "none.json"), "--out", str(out)], check=False, timeout=60)
    (line,) = [x for x in _refused(proc, "prepare").splitlines() if "hpctrain prepare" in x]
    assert "none.json does not exist" in line, line  # (mpirun may add its own lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize("where, serial, why", [
    ("write", "0", "No space left on device"),  # parallel HDF5: after the collective open
    ("write", "1", "No space left on device"),  # the ranks write in turn
    ("read", "0", "RuntimeError: injected failure"),  # before the first collective
])
def test_one_rank_failing_fails_the_whole_prepare(tmp_path, where, serial, why):
    """Rank 1 alone fails (a full disk, or an unexpected error reading its documents): every
    rank knows before the rename, so nothing is committed: exit 2, one message naming rank
    1 and its error, the file already at --out unchanged, no OUT.tmp left, no hang."""
    src = _texts(tmp_path, 6)
    out = tmp_path / "d.h5"
    out.write_bytes(b"the previous data file")
    proc = mpirun(2, ["tests/e2e/prepare_fault.py", "1", where, str(src), "--out", str(out)],
                  check=False, timeout=90, extra_env={"HPCTRAIN_PREPARE_SERIAL": serial})
    (line,) = [x for x in _refused(proc, "prepare").splitlines() if "hpctrain prepare" in x]
    assert "rank 1" in line and why in line, line
    assert "wrote" not in proc.stdout, proc.stdout
    assert out.read_bytes() == b"the previous data file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5", "src"]


def test_serial_writer_is_the_same_file_for_1_2_3_ranks(tmp_path):
    """The writer for an h5py without MPI (the ranks write in turn): 2 text files, JSONL
    shards (plain, .gz, .zst) and Parquet shards on 1, 2 and 3 ranks (ranks without a
    document) give the same bytes, and the parallel writer's; the counts per input are the
    same and no spill file is left."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the first and longer document\n" * 150)
    (src / "b.txt").write_text("the second\n" * 40)
    shards = tmp_path / "shards"
    shards.mkdir()
    texts = [f"record {i}: " + "some text " * (i % 5 + 1) for i in range(24)]
    write_jsonl(shards / "0.jsonl", texts[:8])
    write_jsonl(shards / "1.jsonl.gz", texts[8:12])
    write_jsonl(shards / "2.jsonl.zst", texts[12:16])
    write_parquet(shards / "3.parquet", texts[16:], rows_per_group=3)
    files, said = {}, {}
    for n, serial in ((1, "1"), (2, "1"), (3, "1"), (3, "0")):
        out = tmp_path / f"d{n}{serial}.h5"
        proc = mpirun(n, ["-m", "hpctrain", "prepare", str(src), str(shards / "*"),
                          "--val-fraction", "0", "--out", str(out)], timeout=90,
                      extra_env={"HPCTRAIN_PREPARE_SERIAL": serial})
        assert proc.stdout.count("wrote ") == 1 and "26 documents" in proc.stdout, proc.stdout
        files[n, serial], said[n, serial] = out.read_bytes(), proc.stdout.replace(out.name, "")
    assert files[1, "1"] == files[2, "1"] == files[3, "1"] == files[3, "0"]
    assert len(set(said.values())) == 1
    assert f"  {shards / '*'}: 24 + 0 documents" in said[1, "1"], said[1, "1"]
    with h5py.File(tmp_path / "d31.h5", "r") as f:
        counts = json.loads(f.attrs["source_counts"])
        assert [c["train_documents"] for c in counts] == [2, 24]
        tokens = f["train/tokens"][...].tobytes()
    assert tokens.endswith("".join(texts).encode())  # the global order: inputs, paths, records
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []


def _token_file(path, doc_starts: bool = True) -> str:
    """A small prepared file (random bytes); without ``doc_starts`` when asked."""
    rng = np.random.default_rng(7)
    write_token_file(path, rng.integers(0, 256, 4000), rng.integers(0, 256, 400))
    if not doc_starts:
        with h5py.File(path, "a") as f:
            del f["train/doc_starts"], f["val/doc_starts"]
    return str(path)


def test_a_blend_with_a_missing_source_is_refused_before_any_collective(tmp_path):
    blend = (f'data.sources=[{{path="{_token_file(tmp_path / "a.h5")}", weight=1}}, '
             f'{{path="{tmp_path / "gone.h5"}", weight=1}}]')
    proc = mpirun(2, train_args(tmp_path / "run", blend, "topology.dp=2"), check=False,
                  timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "data.sources[1].path=" in x]
    assert len(lines) == 1 and "does not exist" in lines[0], proc.stderr


def test_file_without_doc_starts_is_refused(tmp_path):
    old = _token_file(tmp_path / "old.h5", doc_starts=False)
    proc = mpirun(2, train_args(tmp_path / "run", "data.document_mask=true",
                                f"data.path={old!r}", "topology.dp=2"), check=False)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "has no train/doc_starts" in proc.stderr and "Traceback" not in proc.stderr
    assert "data.document_mask = false" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
