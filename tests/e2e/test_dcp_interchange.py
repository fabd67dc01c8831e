"""torch Distributed Checkpoint (DCP) interchange through the real CLI (docs/models.md):
checkpoints written by torch's DCP writer in torchtitan's Llama 3 layout (one process, or two
FSDP2-like ranks each saving its dim-0 shards; tests/e2e/titan_writer.py) import with their
AdamW moments and step, equal the same model imported from Hugging Face bit for bit, generate
transformers' greedy tokens, resume on tp2 x pp2 like on one rank, and export back to what
torch's DCP loader reads into the writer's names, shapes and dtypes. Bad input is one message,
exit 2, nothing written."""

import os
import subprocess

import h5py
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tests.e2e import titan_writer
from tests.e2e.test_hf_interchange import HF_SIZES, assert_generates_greedy
from tests.launch import PY, ROOT, TINY, assert_same, read_params, train_cli

pytestmark = pytest.mark.e2e

SETS = ("model.n_layers=2", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.steps=3", "model.dtype=float32")
FORMS = {"classic-2-ranks": dict(ranks=2), "2026-names": dict(
    qkv="attention.qkv_linear.", head="lm_head.weight")}


def import_args(dcp_dir, out, *sets):
    return ("import", "--format", "dcp", dcp_dir, "--config", TINY, "--out", out,
            *[a for s in (*SETS, *sets) for a in ("--set", s)])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """form -> (DCP dir, HF dir of the same weights, model, optimizer), each written once."""
    cache = {}

    def make(form: str):
        if form not in cache:
            d = tmp_path_factory.mktemp("titan")
            model, opt = titan_writer.write(d / "dcp", HF_SIZES, hf=d / "hf", **FORMS[form])
            cache[form] = (d / "dcp", d / "hf", model, opt)
        return cache[form]

    return make


@pytest.fixture(params=sorted(FORMS))
def titan(request, made):
    return made(request.param)


def dcp_tensors(directory) -> dict:
    """Every tensor entry of a DCP checkpoint, loaded with torch's own reader."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
             if not isinstance(v, BytesStorageMetadata)}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


def test_import_equals_the_hf_import_with_the_writers_moments(titan, tmp_path, cli):
    """Parameters bit for bit the Hugging Face import of the same weights (so the rotary rows
    are back in rotate-half order); AdamW's moments torch's own, in hpctrain's names; the
    step and the optimizer's step both 1."""
    directory, hf, model, opt = titan
    rc, out, err = cli(*import_args(directory, tmp_path / "t.h5"))
    assert rc == 0 and "checkpoint.resume" in out, err
    assert cli("import", hf, "--out", tmp_path / "hf.h5")[0] == 0
    mine, theirs = read_params(tmp_path / "t.h5", ""), read_params(tmp_path / "hf.h5")
    assert {k for k in mine if k.startswith("model/")} == set(theirs)
    for name, value in theirs.items():
        assert mine[name].tobytes() == value.tobytes(), name
    from hpctrain.interchange.hf_import import HFReader
    from hpctrain.interchange.hf_map import entries

    params = dict(model.named_parameters())
    for e in entries(HFReader(hf).model_config()):
        state = opt.state[params[e.key]]
        for which in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(mine[f"optim/{e.name}/{which}"], state[which].numpy()), e.key
    with h5py.File(tmp_path / "t.h5") as f:
        assert (int(f.attrs["step"]), int(f.attrs["optim_step"])) == (1, 1)
    assert cli("inspect", tmp_path / "t.h5", "--verify")[1].count("verify ok") == 1


def test_import_generates_transformers_greedy_tokens(titan, tmp_path, cli):
    """``generate`` from the import gives the tokens transformers' ``generate`` gives from
    the same weights (a wrong rotary order would not)."""
    directory, hf, *_ = titan
    assert cli(*import_args(directory, tmp_path / "t.h5"))[0] == 0
    assert_generates_greedy(cli, tmp_path / "t.h5", hf)


def test_round_trip_is_bit_exact(titan, tmp_path, cli):
    """export --format dcp of the import: torch's DCP loader reads every tensor the writer
    saved (model and optimizer state) with the same name, shape, dtype and bytes."""
    directory, *_ = titan
    assert cli(*import_args(directory, tmp_path / "t.h5"))[0] == 0
    rc, out, err = cli("export", tmp_path / "t.h5", "--format", "dcp", "--out", tmp_path / "b")
    assert rc == 0, err
    a, b = dcp_tensors(directory), dcp_tensors(tmp_path / "b")
    assert set(a) == set(b)
    for key, value in a.items():
        assert b[key].dtype == value.dtype and torch.equal(b[key], value), key
    state = {"train_state.step": None}
    dcp.load(state, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert state["train_state.step"] == 1


def test_resumes_on_tp2_pp2_like_one_rank_and_exports(made, tmp_path, cli):
    """The two-rank writer's checkpoint imported (float64) and resumed at step 1 on tp2 x pp2
    trains as on one rank (1e-9); that run's checkpoint exports to DCP holding its
    parameters in the writer's order, its moments and step 3."""
    directory = made("classic-2-ranks")[0]
    imported = tmp_path / "t64.h5"
    assert cli(*import_args(directory, imported, "model.dtype=float64"))[0] == 0
    sets = (*SETS, "model.dtype=float64", f"checkpoint.resume={imported}")
    ref = train_cli(tmp_path / "one", 1, *sets)
    assert f"resumed from {imported} at step 1" in (tmp_path / "one" / "train.log").read_text()
    run = train_cli(tmp_path / "tp2pp2", 4, *sets, "topology.tp=2", "topology.pp=2")
    assert_same(run, ref, 1e-9, "DCP import resumed on tp2 x pp2 against one rank")
    ckpt = tmp_path / "tp2pp2" / "checkpoints"
    assert cli("export", ckpt, "--format", "dcp", "--out", tmp_path / "b")[0] == 0
    back = dcp_tensors(tmp_path / "b")
    wq = back["layers.1.attention.wq.weight"]
    assert wq.dtype == torch.float64
    assert torch.equal(wq, titan_writer.interleaved(torch.from_numpy(
        run.params["model/blocks.1.attn.wq"]), HF_SIZES["num_attention_heads"]))
    assert back["optimizer.state.norm.weight.step"].item() == 3.0


def refused(cli, tmp_path, *args):
    rc, out, err = cli(*args)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    assert not (tmp_path / "out.h5").exists()
    return err


def test_bad_input_is_one_message_and_nothing_written(titan, tmp_path, cli):
    directory, *_ = titan
    out = tmp_path / "out.h5"
    err = refused(cli, tmp_path, "import", "--format", "dcp", directory, "--out", out)
    assert "--config" in err
    err = refused(cli, tmp_path, *import_args(directory, out, "model.n_layers=3"))
    assert "9 missing" in err and "layers.2." in err
    err = refused(cli, tmp_path, *import_args(directory, out, "model.d_ff=48"))
    assert "feed_forward.w1.weight (64, 32)" in err and "(48, 32)" in err
    err = refused(cli, tmp_path, *import_args(directory, out, "model.family=qwen3",
                                              "model.qk_norm=true"))
    assert "family = 'llama'" in err
    err = refused(cli, tmp_path, *import_args(tmp_path, out))
    assert "not a torch distributed checkpoint" in err.lower() or "Hugging Face" in err


def test_partial_optimizer_state_is_refused(tmp_path, cli):
    """Moments for some parameters only: refused, not resumed with part of Adam reset."""
    model, opt = titan_writer.trained(HF_SIZES, 3)
    state = titan_writer.titan_state(model, opt, HF_SIZES, "attention.", "output.weight", True)
    del state["optimizer.state.norm.weight.exp_avg_sq"]
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")), no_dist=True)
    err = refused(cli, tmp_path, *import_args(tmp_path / "d", tmp_path / "out.h5"))
    assert "optimizer.state.norm.weight.exp_avg_sq" in err


MEASURE = """
import sys
from hpctrain.__main__ import main
rc = main(sys.argv[1:])
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print("PEAK", int(peak.split()[1]) // 1024, rc)
"""  # VmHWM: this process's own peak (ru_maxrss would start at the forking parent's)


def test_conversion_memory_does_not_grow_with_the_model(tmp_path):
    """Peak memory of ``import`` (then ``export``) of a 2-layer and an 8-layer model with
    2 MiB tensors: the larger adds 4x the checkpoint bytes but not their memory (one tensor in
    flight: < 30 MiB more, while its parameters and moments are 126 MiB more)."""
    sizes = dict(HF_SIZES, hidden_size=256, intermediate_size=2048, num_attention_heads=8,
                 num_key_value_heads=8)
    peaks = {}
    for layers in (2, 8):
        d = tmp_path / f"l{layers}"
        titan_writer.write(d / "dcp", dict(sizes, num_hidden_layers=layers))
        args = import_args(d / "dcp", d / "t.h5", f"model.n_layers={layers}", "model.d_model=256",
                           "model.d_ff=2048", "model.n_kv_heads=8")
        for what, cmd in (("import", args), ("export", ("export", d / "t.h5", "--format",
                                                         "dcp", "--out", d / "back"))):
            proc = subprocess.run([PY, "-c", MEASURE, *map(str, cmd)], capture_output=True,
                                  text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            peak, rc = proc.stdout.split("PEAK")[-1].split()
            assert rc == "0", proc.stderr
            peaks[what, layers] = int(peak)  # MiB
    for what in ("import", "export"):
        grew = peaks[what, 8] - peaks[what, 2]
        assert grew < 30, f"{what}: peak grew {grew:.0f} MiB from 2 to 8 layers ({peaks})"
