"""16-bit gradient traffic in one launch: ``optim.grad_comm_dtype =
"bfloat16"`` on dp=2 halves the bytes of the dp reduction and tracks float32 traffic (a
tolerance, not equality: each bucket is rounded to bfloat16 once per rank and per partial
sum). Blocking buckets, the posted reduce-scatter of ZeRO-1 with overlap, and HSDP's
all-reduce across shard groups (shard groups of one rank: the whole sum crosses groups) run."""

import numpy as np
import pytest
from inprocess import train_layout

COMMON = ('model.dtype="float32"', "model.n_layers=2", "topology.dp=2", "train.steps=20",
          "train.micro_batch_size=4", "checkpoint.save_final=false")
BF16 = 'optim.grad_comm_dtype="bfloat16"'


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wire")
    return {
        "f32": train_layout(root / "f32", 2, *COMMON),
        "bf16": train_layout(root / "bf16", 2, *COMMON, BF16),
        "bf16 zero1 overlap": train_layout(root / "z1", 2, *COMMON, BF16, "optim.zero=1",
                                        "optim.overlap=true"),
        "bf16 hsdp": train_layout(root / "hsdp", 2, *COMMON, BF16, "optim.zero=3",
                               'topology.shard_within="1"'),
    }


def _dp_bytes(run) -> float:
    return sum(m["comm_bytes"].get("dp", 0) for m in run.metrics)


@pytest.mark.parametrize("name", ["bf16", "bf16 zero1 overlap", "bf16 hsdp"])
def test_bfloat16_traffic_tracks_float32(runs, name):
    ref, run = runs["f32"], runs[name]
    rel = np.abs(run.losses - ref.losses) / ref.losses
    assert rel.max() <= 0.01, f"{name} departs from float32 traffic by {rel.max():.2%}"
    gn = np.abs(run.grad_norms - ref.grad_norms) / ref.grad_norms
    assert 0 < gn.max() <= 0.02, f"{name}: gradient norms {gn.max():.2%} from float32's"
    assert run.losses[-3:].mean() < run.losses[:3].mean() - 0.1  # and it learns


def test_bfloat16_traffic_halves_the_dp_bytes(runs):
    ratio = _dp_bytes(runs["bf16"]) / _dp_bytes(runs["f32"])
    assert ratio == pytest.approx(0.5, rel=0.02), ratio


def test_hsdp_carries_bfloat16_across_shard_groups(runs):
    per_step = runs["bf16 hsdp"].metrics[-1]["comm_bytes"]
    # the 2 bytes of each gradient element, summed once across the two groups
    assert per_step.get("dp-replica", 0) > 0, per_step
    assert per_step["dp-replica"] <= 0.55 * _dp_bytes_step(runs["f32"]), per_step


def _dp_bytes_step(run) -> float:
    return run.metrics[-1]["comm_bytes"]["dp"]
