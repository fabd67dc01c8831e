"""Checkpoints through the real CLI: exact resume, serial <-> parallel files, damaged files
detected and skipped, a rank killed mid-save, HDF5 tools, inspect and export."""

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from launch import baseline, hpctrain, mpirun, read_params, read_run, train_args, train_cli

pytestmark = pytest.mark.e2e

SIX = ("train.steps=6",)


def ckpt(run, step: int) -> str:
    return str(run.run_dir / "checkpoints" / f"step_{step:08d}.h5")


def same_bits(a, b, what):
    assert np.array_equal(np.asarray(a), np.asarray(b)), f"{what}: {a} != {b}"


def assert_same_state(a: Path, b: Path):
    """Every model and optimizer tensor bitwise equal."""
    pa, pb = read_params(a, ""), read_params(b, "")
    pa.pop("rng/torch"), pb.pop("rng/torch")
    assert set(pa) == set(pb) and any(k.startswith("optim/") for k in pa)
    for k in pa:
        same_bits(pa[k], pb[k], k)


def test_resume_is_bitwise_and_serial_files_read_both_ways(tmp_path):
    # A: 6 steps straight (parallel HDF5), saving at 3 and 6.
    a = train_cli(tmp_path / "a", 2, "topology.dp=2", *SIX, "checkpoint.every=3")
    # B: restart from A's step 3 with the serial fallback; it saves at 4 and 6 (serially).
    b = train_cli(tmp_path / "b", 2, "topology.dp=2", *SIX, "checkpoint.every=2",
                  f"checkpoint.resume={ckpt(a, 3)}", extra_env={"HPCTRAIN_CKPT_SERIAL": 1})
    # C: restart from B's serially written step 4 with parallel HDF5.
    # (C also passes alignment and MPI-IO hints through [checkpoint].)
    c = train_cli(tmp_path / "c", 2, "topology.dp=2", *SIX, f"checkpoint.resume={ckpt(b, 4)}",
                  "checkpoint.alignment=65536", 'checkpoint.mpi_hints={cb_nodes = "1"}')
    same_bits(b.losses, a.losses[3:], "serial resume from a parallel file")
    same_bits(c.losses, a.losses[4:], "parallel resume from a serial file")
    same_bits(b.grad_norms, a.grad_norms[3:], "grad norms")
    for run, writer in ((a, "mpio"), (b, "serial"), (c, "mpio")):
        with h5py.File(ckpt(run, 6), "r") as f:
            assert f.attrs["writer"] == writer
            assert f.attrs["step"] == 6 and f.attrs["data_next_step"] == 6
            assert f.attrs["data_samples_seen"] == 6 * 16
            for key in ("config", "versions", "topology", "rng_layout", "data_hash"):
                assert f.attrs[key], key
            assert f["rng/torch"].shape[0] == 2
    with h5py.File(ckpt(c, 6), "r") as f:
        assert json.loads(f.attrs["layout"])["mpi_hints"] == {"cb_nodes": "1"}
        assert f["model/embed"].nbytes >= 65536 and f["model/embed"].id.get_offset() % 65536 == 0
    assert_same_state(Path(ckpt(a, 6)), Path(ckpt(b, 6)))
    assert_same_state(Path(ckpt(a, 6)), Path(ckpt(c, 6)))
    # Metrics: save and load time and bandwidth.
    first = b.metrics[0]
    assert first["ckpt_load_s"] > 0 and first["ckpt_load_bytes"] > 0
    assert a.metrics[2]["ckpt_save_bytes"] > 0 and a.metrics[2]["ckpt_save_GBps"] > 0
    # The standard HDF5 tools read the file.
    ls = subprocess.run(["h5ls", "-r", ckpt(a, 6)], capture_output=True, text=True, check=True)
    assert "/model/blocks.0.attn.wq  Dataset {32, 32}" in ls.stdout
    assert "/optim/blocks.0.attn.wq/exp_avg_sq" in ls.stdout
    dump = subprocess.run(["h5dump", "-H", ckpt(a, 6)], capture_output=True, text=True,
                          check=True)
    assert 'ATTRIBUTE "crc32"' in dump.stdout and 'DATASET "rng"' not in dump.stdout
    for group in ("/model", "/optim"):  # HDF5's own reader: both writers' bytes are equal
        subprocess.run(["h5diff", ckpt(a, 6), ckpt(b, 6), group, group], check=True)


def _flip_in_data(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        needle = np.ascontiguousarray(f[dataset][...]).tobytes()[:64]
    raw = bytearray(path.read_bytes())
    pos = raw.find(needle)
    assert pos > 0
    raw[pos + 5] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_killed_save_and_damaged_files_fall_back_to_a_sound_checkpoint(tmp_path):
    """Rank 1 dies while step 6 is written; then the newest committed file gets flipped
    bytes and the one before is truncated: resume=auto warns and takes the one before."""
    config = str(Path(__file__).parents[2] / "share/configs/tiny.toml")
    run_dir = tmp_path / "a"
    args = train_args(run_dir, "topology.dp=2", "train.steps=6", "checkpoint.every=1",
                      config=config)
    proc = mpirun(2, args, check=False, timeout=180, extra_env={
        "HPCTRAIN_FAULTS": "ckpt_kill@1:6"})
    assert proc.returncode != 0
    assert "rank 1 killed while saving step 6" in proc.stderr
    d = run_dir / "checkpoints"
    assert (d / "latest").read_text().strip() == "step_00000005.h5"
    assert not (d / "step_00000006.h5").exists()
    assert sorted(p.name for p in d.glob("step_*.h5")) == [
        "step_00000003.h5", "step_00000004.h5", "step_00000005.h5"]  # keep = 3
    assert hpctrain(["inspect", str(d), "--verify"]).returncode == 0
    a = read_run(run_dir)  # steps 1..5 were logged before the kill

    _flip_in_data(d / "step_00000005.h5", "optim/blocks.3.mlp.w1/exp_avg")
    step4 = d / "step_00000004.h5"
    step4.write_bytes(step4.read_bytes()[: step4.stat().st_size * 2 // 3])
    for bad, what in (("step_00000005.h5", "checksum mismatch"), ("step_00000004.h5", "")):
        proc = hpctrain(["inspect", str(d / bad), "--verify"], check=False)
        assert proc.returncode == 1 and "VERIFY FAILED" in proc.stdout, proc.stdout
        assert what in proc.stdout

    args = ["-m", "hpctrain", "train", config, "--run-dir", str(tmp_path / "b"), "--set",
            "train.steps=6", "--set", "checkpoint.resume=auto", "--set", f"checkpoint.dir={d}"]
    proc = mpirun(1, args)
    assert "step_00000005.h5 is damaged" in proc.stderr and "falling back" in proc.stderr
    assert "step_00000004.h5 is damaged" in proc.stderr
    assert "step_00000003.h5 at step 3" in proc.stdout
    b = read_run(tmp_path / "b")
    assert len(b.losses) == 3
    err = np.max(np.abs(b.losses[:2] - a.losses[3:5]) / np.abs(a.losses[3:5]))
    assert err <= 1e-9, (b.losses, a.losses)  # dp=2 -> 1 rank continues the same run
    assert not list(d.glob(".step_*.tmp"))  # the next save removed the half-written file


def test_inspect_and_export_safetensors(tmp_path, session_dir):
    from safetensors.numpy import load_file

    ref = baseline(session_dir)
    d = ref.run_dir / "checkpoints"
    info = json.loads(hpctrain(["inspect", str(d), "--json", "--verify"]).stdout)
    assert info["problems"] == [] and info["attrs"]["step"] == 5
    names = {t["name"] for t in info["tensors"]}
    assert "model/embed" in names and "optim/embed/exp_avg" in names
    text = hpctrain(["inspect", str(d), "--verify"]).stdout  # the lineage in text too
    assert "lineage data       source=embedded" in text and "content_hash=" in text, text
    assert "decay_steps" in text and text.rstrip().endswith("match their checksums")
    out = tmp_path / "export" / "model.safetensors"
    hpctrain(["export", str(d), "--format", "safetensors", str(out)])
    tensors = load_file(str(out))
    assert set(tensors) == {k[len("model/"):] for k in ref.params}
    for k, v in ref.params.items():
        same_bits(tensors[k[len("model/"):]], v, k)
    assert "[model]" in Path(str(out) + ".config.toml").read_text()
