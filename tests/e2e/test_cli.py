"""The CLI as a user runs it: errors before any collective, prepare, a run directory."""

import json
import subprocess
import time

import pytest
from launch import LAUNCHER, PY, ROOT, TINY, env, hpctrain, mpirun, train_args, train_cli

from hpctrain.job.launch import command

pytestmark = pytest.mark.e2e


def test_impossible_layout_fails_fast_with_arithmetic(tmp_path):
    proc = mpirun(2, ["-m", "hpctrain", "train", TINY, "--run-dir", str(tmp_path),
                      "--set", "topology.dp=4"], check=False, timeout=60)
    assert proc.returncode != 0
    assert "dp*tp*pp = 4*1*1 = 4 but the world has 2 ranks" in proc.stderr
    assert proc.stderr.count("world has 2 ranks") == 1  # said once, by rank 0
    assert not (tmp_path / "metrics.jsonl").exists()


def test_refused_telemetry_key_under_mpirun_without_mpi4py(tmp_path):
    """A negative watchdog is refused with the config, before any collective and before
    torch is imported: exit 2 on 2 ranks, said once; the time is printed (a bound
    generous for a loaded machine: the start of Python, mpi4py and h5py per rank)."""
    cmd = command(2, PY, *train_args(tmp_path / "run", "telemetry.watchdog_s=-5"),
                  launcher=LAUNCHER)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    print(f"refused on 2 ranks in {took:.1f} s")
    assert "telemetry.watchdog_s=-5.0 must be >= 0" in _refused(proc)
    assert not (tmp_path / "run").exists()
    assert took < 30, f"a refused config took {took:.1f} s"


def test_unknown_key_and_bad_type():
    p = hpctrain(["train", TINY, "--run-dir", "/tmp/x", "--set", "train.stepz=3"], check=False)
    assert p.returncode == 2 and "unknown key train.stepz" in p.stderr
    p = hpctrain(["train", TINY, "--run-dir", "/tmp/x", "--set", "train.steps=abc"], check=False)
    assert p.returncode == 2 and "train.steps must be an integer" in p.stderr


def test_prepare_then_train_on_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text(f"line {i} of some text to learn from\n" * 40)
    data = tmp_path / "data.h5"
    out = hpctrain(["prepare", str(src), "--out", str(data), "--val-fraction", "0.1"])
    assert "40 documents" in out.stdout
    run = train_cli(tmp_path / "run", 2, "topology.dp=2", f"data.path=\"{data}\"",
                    "train.steps=3")
    assert len(run.losses) == 3
    rec = run.metrics[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert key in rec
    assert (tmp_path / "run" / "config.toml").read_text().count("[topology]") == 1
    assert "step 3/3" in run.stdout and "tok/s" in run.stdout and "ETA" in run.stdout
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and "startup_s" not in run.metrics[1]
    phases = first["startup_s"]  # the run's start-up, phase by phase, in order
    assert list(phases) == ["python", "mpi", "checks", "torch", "entry", "topology", "model",
                            "data", "restore", "telemetry", "first_step"]
    assert all(s >= 0 for s in phases.values()) and phases["torch"] > 0.05
    assert f"start-up to the end of the first step: {sum(phases.values()):.1f} s" in run.stdout


def _refused(proc, command: str = "train") -> str:
    """Exit 2, one message on stderr (said once, by rank 0), no traceback; the message."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stderr.count(f"hpctrain {command}: ") == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def _all_bytes(tmp_path, name="all_bytes.h5"):
    """A prepared file whose tokens reach id 255 (byte 0xFF never occurs in UTF-8 text)."""
    src = tmp_path / "bin"
    src.mkdir(exist_ok=True)
    for i in range(8):
        (src / f"{i}.bin").write_bytes(bytes(range(256)) * 8)
    out = tmp_path / name
    hpctrain(["prepare", str(src), "--binary", "--out", str(out)])
    return out


def test_vocabulary_smaller_than_the_data_is_refused(tmp_path):
    """At tp=1 an id past the vocabulary was an IndexError in the loss; at tp>1 a target
    outside every shard counted as logit 0 (a wrong loss, silently). Refused before any
    collective, by train and by plan, with the file, its largest id and the vocabulary."""
    data = _all_bytes(tmp_path)
    sets = ["--set", f'data.path="{data}"', "--set", "model.vocab_size=255"]
    err = _refused(hpctrain(["train", TINY, "--run-dir", str(tmp_path / "r1"), *sets],
                            check=False))
    assert f"data.path={data}: largest token id 255" in err and "model.vocab_size=255" in err
    assert not (tmp_path / "r1").exists()
    err = _refused(hpctrain(["plan", TINY, "--world-size", "1", *sets], check=False), "plan")
    assert "largest token id 255" in err
    # tp = 2 (the silent case) under mpirun: every rank refuses, rank 0 says it once.
    proc = mpirun(2, ["-m", "hpctrain", "train", TINY, "--run-dir", str(tmp_path / "r2"),
                      "--set", "topology.tp=2", *sets], check=False, timeout=60)
    assert "largest token id 255" in _refused(proc)
    # The embedded corpus: its largest id (computed from its tokens) against vocab 100.
    err = _refused(hpctrain(["plan", TINY, "--world-size", "1", "--set",
                             "model.vocab_size=100"], check=False), "plan")
    assert "the embedded corpus" in err and "model.vocab_size=100" in err
    hpctrain(["plan", TINY, "--world-size", "1", "--set", "model.vocab_size=256", *sets[:2]])


def test_old_data_file_without_the_attribute(tmp_path):
    """Prepared before max_token_id was recorded: the largest id is computed from the tokens."""
    import h5py

    data = _all_bytes(tmp_path)
    with h5py.File(data, "a") as f:
        del f.attrs["max_token_id"]
    err = _refused(hpctrain(["train", TINY, "--run-dir", str(tmp_path / "r"), "--set",
                             f'data.path="{data}"', "--set", "model.vocab_size=200"],
                            check=False))
    assert "largest token id 255" in err and "model.vocab_size >= 256" in err


def _damaged_inputs(tmp_path) -> dict:
    """name -> (extra CLI args, what stderr must say). The run directory is tmp_path/run."""
    import h5py
    import numpy as np

    data = _all_bytes(tmp_path)
    raw = data.read_bytes()
    (tmp_path / "truncated.h5").write_bytes(raw[: len(raw) // 3])
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f.create_dataset("weights", data=np.ones((3, 3)))
    (tmp_path / "a_file").write_text("not a directory\n")
    d = lambda p: ["--set", f'data.path="{p}"']  # noqa: E731
    return {
        "truncated": (d(tmp_path / "truncated.h5"), "cannot be read as HDF5"),
        "foreign": (d(tmp_path / "foreign.h5"), "is not an hpctrain data file"),
        "missing data": (d(tmp_path / "nope.h5"), "nope.h5 does not exist"),
        "run dir is a file": (["--run-dir", str(tmp_path / "a_file")], "is not a directory"),
        "run dir under a file": (["--run-dir", str(tmp_path / "a_file" / "run")],
                                 "is not a directory"),
        "checkpoint dir is a file": (["--set", f'checkpoint.dir="{tmp_path / "a_file"}"'],
                                     "is not a directory"),
        "missing resume": (["--set", f'checkpoint.resume="{tmp_path / "nock.h5"}"'],
                           "no checkpoint there"),
        "missing config": (["--config", str(tmp_path / "nope.toml")], "does not exist"),
    }


def test_damaged_inputs_are_refused_and_nothing_is_written(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("# an earlier run's\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    for name, (extra, says) in _damaged_inputs(tmp_path).items():
        args = ["train", TINY, "--run-dir", str(run_dir)]
        if extra[0] == "--config":
            args[1] = extra[1]
        elif extra[0] == "--run-dir":
            args[3] = extra[1]
        else:
            args += extra
        err = _refused(hpctrain(args, check=False))
        assert says in err, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before, name
        assert (tmp_path / "a_file").read_text() == "not a directory\n"


def test_damaged_data_on_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("# an earlier run's\n")
    extra, says = _damaged_inputs(tmp_path)["truncated"]
    proc = mpirun(2, ["-m", "hpctrain", "train", TINY, "--run-dir", str(run_dir),
                      "--set", "topology.dp=2", *extra], check=False, timeout=60)
    assert says in _refused(proc)
    assert (run_dir / "config.toml").read_text() == "# an earlier run's\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml"]


def test_prepare_reports_bad_sources_in_one_line(tmp_path):
    for args, says in [([str(tmp_path / "nope.txt")], "neither a file nor a directory"),
                       ([str(tmp_path)], "no input documents")]:
        p = hpctrain(["prepare", *args, "--out", str(tmp_path / "x.h5")], check=False)
        assert p.returncode == 2 and p.stderr.startswith("hpctrain prepare: "), p.stderr
        assert says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    (tmp_path / "a.txt").write_text("some text\n" * 10)
    p = hpctrain(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d.h5")])
    assert "largest token id 120" in p.stdout  # 'x'
