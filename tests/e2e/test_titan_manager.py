"""torchtitan's interval saves through the real CLI (docs/interchange.md): a ``step-N`` folder
written by torchtitan's own ``CheckpointManager`` (tests/e2e/titan_manager_writer.py: model,
optimizer, lr scheduler, data loader and train state; 0.3.0's fused q/k/v and its trainer's
int step, or the int32 tensor step of torchtitan before 0.1) imports with its weights, AdamW
moments and both steps, naming what it does not carry; its export is loaded back by
torchtitan's own ``CheckpointManager.load`` into a fresh model, optimizer and train state."""

import h5py
import numpy as np
import pytest
import torch

from tests.e2e import titan_manager_writer as writer
from tests.e2e.test_hf_interchange import HF_SIZES
from tests.launch import TINY, read_params

pytestmark = pytest.mark.e2e

SETS = ("model.n_layers=2", "train.global_batch_size=8", "train.micro_batch_size=2",
        "model.dtype=float32")
STEP = f"step-{writer.INTERVAL}"


def import_args(directory, out):
    return ("import", "--format", "dcp", directory, "--config", TINY, "--out", out,
            *[a for s in SETS for a in ("--set", s)])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """form -> (the save's step-N folder, the writer's components as saved), made once."""
    cache = {}

    def make(form: str):
        if form not in cache:
            folder = tmp_path_factory.mktemp(form) / "checkpoint"
            c = writer.train_and_save(folder, HF_SIZES, writer.FORMS[form])
            cache[form] = (folder / STEP, c)
        return cache[form]

    return make


def hpctrain_names() -> dict:
    """{Hugging Face name: hpctrain parameter} of the tests' model."""
    from hpctrain.config import load
    from hpctrain.interchange.hf_map import entries
    from hpctrain.model.families import resolved

    return {e.key: e.name for e in entries(resolved(load(TINY, list(SETS)).model))}


def optimizer_state(flat: dict, which: str) -> dict:
    """{parameter: tensor} of the optimizer's ``which`` in torchtitan's flat state dict."""
    tail = f".{which}"
    return {k[len("state."):-len(tail)]: v for k, v in flat.items()
            if k.startswith("state.") and k.endswith(tail)}


@pytest.mark.parametrize("form", sorted(writer.FORMS))
def test_import_carries_weights_moments_and_the_train_states_step(saved, form, tmp_path, cli):
    """The weights bit for bit the model's, the moments the optimizer's (fused q/k/v split),
    the step the train state's (5, not the optimizer's 2, which is kept as its own); the
    data loader, the scheduler, the hyperparameters and the rest of the train state are
    named as not carried."""
    directory, c = saved(form)
    rc, out, err = cli(*import_args(directory, tmp_path / "t.h5"))
    assert rc == 0, err
    assert f"resume it at step {writer.INTERVAL}" in out
    left = out.split("not carried: ")[1]
    named = {"titan-0.3": ["dataloader.dp_rank_0", "dataloader.world_size",
                           "lr_scheduler.last_epoch", "train_state.ntokens_seen"],
             "titan-before-0.1": ["dataloader.dp_rank_0", "lr_scheduler.last_epoch",
                                  "train_state.global_avg_losses", "train_state.log_steps"]}
    for name in named[form]:
        assert name in left, (name, left)
    assert "optimizer.param_groups.<parameter>.{" in left and "betas" in left
    assert "train_state.step" not in left and "exp_avg" not in left
    with h5py.File(tmp_path / "t.h5") as f:
        steps = int(f.attrs["step"]), int(f.attrs["optim_step"])
    assert steps == (writer.INTERVAL, writer.INTERVAL - writer.START)
    mine, names = read_params(tmp_path / "t.h5", ""), hpctrain_names()
    expected = {"model": writer.to_hf(c["saved"]["model"], HF_SIZES, writer.FORMS[form])}
    for which in ("exp_avg", "exp_avg_sq"):
        expected[which] = writer.to_hf(optimizer_state(c["saved"]["optimizer"], which),
                                       HF_SIZES, writer.FORMS[form])
    for key, name in names.items():
        assert mine[f"model/{name}"].tobytes() == expected["model"][key].numpy().tobytes(), key
        for which in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(mine[f"optim/{name}/{which}"],
                                  expected[which][key].numpy()), (key, which)


def test_export_is_loaded_back_by_torchtitans_checkpoint_manager(saved, tmp_path, cli):
    """export --format dcp of the 0.3.0 import, as step-N of a torchtitan checkpoint folder:
    the ``CheckpointManager`` of a fresh model (other weights), optimizer, scheduler, data
    loader and train state loads it (the data loader excluded: hpctrain's data position is
    not torchtitan's); weights, moments, optimizer step, train step and schedule step equal
    the original save's, the hyperparameters the config's."""
    directory, c = saved("titan-0.3")
    assert cli(*import_args(directory, tmp_path / "t.h5"))[0] == 0
    folder = tmp_path / "checkpoint"
    rc, out, err = cli("export", tmp_path / "t.h5", "--format", "dcp", "--out", folder / STEP)
    assert rc == 0, err
    assert "--checkpoint.exclude_from_loading dataloader" in out
    fresh = writer.components(folder, HF_SIZES, writer.FORMS["titan-0.3"], seed=1,
                              exclude=["dataloader"])
    fresh["state"].step = 0
    assert not torch.equal(fresh["model"].lm_head.weight, c["model"].lm_head.weight)
    assert fresh["manager"].load(step=writer.INTERVAL)
    for key, value in c["saved"]["model"].items():
        assert torch.equal(fresh["model"].state_dict()[key], value), key
    loaded = fresh["optimizers"].state_dict()
    for key, value in c["saved"]["optimizer"].items():
        if key.startswith("state."):
            assert torch.equal(loaded[key], value), key
    assert fresh["state"].step == writer.INTERVAL
    assert fresh["schedulers"].state_dict() == {"last_epoch": writer.INTERVAL}
    group = fresh["optimizers"].optimizers[0].param_groups[0]
    assert (group["betas"], group["eps"], group["initial_lr"]) == ((0.9, 0.95), 1e-6, 2e-3)
    fresh["manager"].close()


@pytest.mark.parametrize("step", ["five", torch.tensor([5, 5], dtype=torch.int32), -1, 2.5],
                         ids=["text", "two-elements", "negative", "fraction"])
def test_a_step_that_is_not_one_count_is_refused(step, tmp_path, cli):
    """A ``train_state.step`` that is not one whole number >= 0: one message naming the
    entry, exit 2, nothing written (not the optimizer's step in its place)."""
    import torch.distributed.checkpoint as dcp

    from tests.e2e import titan_writer

    model, opt = titan_writer.trained(HF_SIZES, 3)
    state = titan_writer.titan_state(model, opt, HF_SIZES, "attention.", "output.weight", True)
    state["train_state.step"] = step
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")), no_dist=True)
    rc, out, err = cli(*import_args(tmp_path / "d", tmp_path / "out.h5"))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    assert "train_state.step" in err and "step count" in err
    assert not (tmp_path / "out.h5").exists()
