"""Tensor-parallel layout validation: tp must divide the heads and the MLP hidden size, and
with sequence parallelism the sequence length; each error names the numbers involved."""

from pathlib import Path

import pytest

from hpctrain.checks.validate import validate
from hpctrain.config import ConfigError, load

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")


@pytest.mark.parametrize("overrides,world,message", [
    (["topology.tp=3"], 3, "model.n_heads=8 is not divisible by topology.tp=3"),
    (["topology.tp=4", "model.n_heads=2", "model.d_model=32"], 4,
     "model.n_heads=2 is not divisible by topology.tp=4 (attention is split by heads)"),
    (["topology.tp=4", "model.d_ff=66"], 4,
     "model.d_ff=66 is not divisible by topology.tp=4 (the MLP is split on its hidden"),
    (["topology.tp=4", "topology.sequence_parallel=true", "train.seq_len=18"], 4,
     "train.seq_len=18 is not divisible by topology.tp=4 (sequence parallelism splits"),
])
def test_tp_layout_errors(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, overrides), world)
    assert message in str(e.value)


def test_seq_len_only_matters_with_sequence_parallelism():
    validate(load(TINY, ["topology.tp=4", "train.seq_len=18"]), 4)


def test_tp_errors_reported_together():
    cfg = load(TINY, ["topology.tp=3", "model.d_ff=64", "topology.sequence_parallel=true",
                      "train.seq_len=16"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 3)
    text = str(e.value)
    for part in ("n_heads=8", "d_ff=64", "seq_len=16"):
        assert f"{part} is not divisible by topology.tp=3" in text, text


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (4, True), (8, False), (8, True)])
def test_tiny_splits_over_tp(tp, sp):
    validate(load(TINY, [f"topology.tp={tp}", f"topology.sequence_parallel={str(sp).lower()}"]),
             tp)
