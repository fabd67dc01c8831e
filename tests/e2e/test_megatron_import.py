"""Megatron-Core ``torch_dist`` checkpoints in, through the real CLI (docs/interchange.md):
written by Megatron-Core's own ``dist_checkpointing.save`` (tests/e2e/megatron_writer.py, in
Megatron-LM's directory layout, layers stacked, fused q/k/v and gate/up), the import gives
Megatron's own forward logits, carries the DistributedOptimizer's moments and step, trains on
tp2 x pp2 like one rank, and exports to torchtitan's DCP. Optimizer state in the flat-buffer
form is named and left out."""

import subprocess

import h5py
import numpy as np
import pytest
import torch

from tests.e2e.test_hf_interchange import own_logits
from tests.launch import PY, ROOT, TINY, assert_same, train_cli

pytestmark = pytest.mark.e2e

SETS = ("model.n_layers=2", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.steps=3", "model.dtype=float32")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """optimizer form ("" for none) -> Megatron-LM save directory, each written once."""
    cache = {}

    def make(optimizer: str = ""):
        if optimizer not in cache:
            out = tmp_path_factory.mktemp("megatron")
            cmd = [PY, str(ROOT / "tests/e2e/megatron_writer.py"), str(out)]
            proc = subprocess.run(cmd + (["--optimizer", optimizer] if optimizer else []),
                                  capture_output=True, text=True, timeout=240, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[optimizer] = out
        return cache[optimizer]

    return make


def import_args(directory, out, *sets):
    return ("import", directory, "--config", TINY, "--out", out,
            *[a for s in (*SETS, *sets) for a in ("--set", s)])


def test_import_gives_megatrons_own_logits(written, tmp_path, cli):
    """Weights only: step 0, and hpctrain's forward on the import equals Megatron's own
    forward on the checkpoint it saved (q/k/v cut per group, gate before up, norms fused
    into the linear layers, rotate-half rotary)."""
    directory = written()
    rc, out, err = cli(*import_args(directory, tmp_path / "m.h5"))
    assert rc == 0 and "Megatron-Core GPT" in out and "init_from" in out, err
    ref = torch.load(directory / "megatron_logits.pt", weights_only=True)
    mine = own_logits(tmp_path / "m.h5", ref["tokens"].tolist())
    err = (mine - ref["logits"]).abs().max().item()
    assert err < 1e-5 and ref["logits"].abs().max().item() > 0.1, err


def test_optimizer_moments_and_step_come_in(written, tmp_path, cli):
    """The fully reshardable DistributedOptimizer state: moments non-zero and laid out as
    the parameters (the fused q/k/v moment is hpctrain's q, k, v moments regrouped), the
    float32 copy as the parameter, step and optimizer step 1 from common.pt."""
    directory = written("fully_reshardable")
    rc, out, err = cli(*import_args(directory, tmp_path / "m.h5"))
    assert rc == 0 and "checkpoint.resume" in out, err
    from hpctrain.interchange.dcp import Reader

    reader = Reader(directory / "iter_0000001")
    fused = reader.tensor("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv"
                          ".weight", 1).numpy()
    with h5py.File(tmp_path / "m.h5") as f:
        assert (int(f.attrs["step"]), int(f.attrs["optim_step"])) == (1, 1)
        q, k, v = (f[f"optim/blocks.1.attn.{x}/exp_avg"][...] for x in ("wq", "wk", "wv"))
        norm = f["optim/blocks.0.norm2.weight/exp_avg_sq"][...]
    groups = fused.reshape(4, 4, 4, 32)  # (groups, 2 queries + k + v, d_head, d_model)
    assert np.array_equal(groups[:, :2].reshape(32, 32), q)
    assert np.array_equal(groups[:, 2].reshape(16, 32), k)
    assert np.array_equal(groups[:, 3].reshape(16, 32), v)
    assert np.abs(q).max() > 0 and np.abs(norm).max() > 0


def test_trains_on_tp2_pp2_like_one_rank_and_exports(written, tmp_path, cli):
    """The import (float64) resumed at step 1 on tp2 x pp2 trains as on one rank (1e-9),
    and that run's checkpoint exports to a DCP torch's loader reads."""
    directory = written("fully_reshardable")
    imported = tmp_path / "m64.h5"
    assert cli(*import_args(directory, imported, "model.dtype=float64"))[0] == 0
    sets = (*SETS, "model.dtype=float64", f"checkpoint.resume={imported}")
    ref = train_cli(tmp_path / "one", 1, *sets)
    run = train_cli(tmp_path / "tp2pp2", 4, *sets, "topology.tp=2", "topology.pp=2")
    assert_same(run, ref, 1e-9, "Megatron import resumed on tp2 x pp2 against one rank")
    rc, out, err = cli("export", tmp_path / "tp2pp2" / "checkpoints", "--format", "dcp",
                       "--out", tmp_path / "titan")
    assert rc == 0 and "step 3" in out, err


def test_flat_buffer_optimizer_state_is_named_and_left_out(written, tmp_path, cli):
    """Megatron-LM's default ``dp_reshardable`` optimizer state is flat gradient buffers:
    the weights come in, and the message says the moments do not and how to get them."""
    rc, out, err = cli(*import_args(written("dp_reshardable"), tmp_path / "m.h5"))
    assert rc == 0 and "dp_reshardable" in out and "fully-reshardable" in out, err
    with h5py.File(tmp_path / "m.h5") as f:
        assert int(f.attrs["step"]) == 0 and not f["optim/embed/exp_avg"][...].any()


def test_wrong_shape_is_refused(written, tmp_path, cli):
    rc, out, err = cli(*import_args(written(), tmp_path / "out.h5", "model.n_kv_heads=8"))
    assert rc == 2 and "linear_qkv.weight (2, 64, 32)" in err and "(2, 96, 32)" in err, err
    assert not (tmp_path / "out.h5").exists()
