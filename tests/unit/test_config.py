"""Config parsing, overrides and every validation error, without MPI."""

import pytest

from hpctrain.config import (
    Config,
    ConfigError,
    dumps_toml,
    from_dict,
    load,
    microbatches,
    parse_override,
)
from hpctrain.validate import validate

TINY = "share/configs/tiny.toml"


def test_presets_load_and_validate():
    cfg = load(TINY)
    assert cfg.model.n_layers == 8 and cfg.model.n_heads == 8 and cfg.model.dtype == "float64"
    validate(cfg, 1)
    demo = load("share/configs/demo.toml")
    validate(demo, 4)
    assert microbatches(demo) == 16 // (4 * 2)


def test_every_layout_up_to_8_ranks_divides_tiny():
    for dp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8):
                n = dp * tp * pp
                if n <= 8:
                    cfg = load(TINY, [f"topology.dp={dp}", f"topology.tp={tp}",
                                      f"topology.pp={pp}"])
                    validate(cfg, n)


@pytest.mark.parametrize("text,expect", [
    ("train.steps=7", ("train", "steps", 7)),
    ("optim.lr=1e-3", ("optim", "lr", 1e-3)),
    ("topology.sequence_parallel=true", ("topology", "sequence_parallel", True)),
    ('model.dtype="float64"', ("model", "dtype", "float64")),
    ("model.dtype=float64", ("model", "dtype", "float64")),  # bare strings allowed
])
def test_parse_override(text, expect):
    assert parse_override(text) == expect


def test_overrides_apply_and_roundtrip(tmp_path):
    cfg = load(TINY, ["train.steps=3", "optim.lr=0.5", "topology.dp=2"])
    assert cfg.train.steps == 3 and cfg.optim.lr == 0.5 and cfg.topology.dp == 2
    p = tmp_path / "resolved.toml"
    p.write_text(dumps_toml(cfg))
    assert load(p) == cfg


def test_int_accepted_for_float():
    assert load(None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("overrides,message", [
    (["nosuch.key=1"], "unknown section [nosuch]"),
    (["train.stepz=1"], "unknown key train.stepz"),
    (["train.steps=1.5"], "train.steps must be an integer"),
    (["train.steps=true"], "train.steps must be an integer"),
    (["optim.lr=\"fast\""], "optim.lr must be a number"),
    (["topology.sequence_parallel=3"], "must be true or false"),
    (["model.dtype=3"], "model.dtype must be a string"),
    (["steps=3"], "must look like section.key=value"),
])
def test_bad_keys_and_types(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(TINY, overrides)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load("nope.toml")


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        from_dict({"train": {"step": 1}})
    assert "global_batch_size" in str(e.value)


@pytest.mark.parametrize("overrides,world,message", [
    (["topology.dp=2"], 4, r"dp\*tp\*pp = 2\*1\*1 = 2 but the world has 4 ranks"),
    (["topology.dp=3"], 3, r"global_batch_size=16 is not divisible by dp\*micro_batch_size = "
                           r"3\*1 = 3"),
    (["topology.dp=2", "train.micro_batch_size=3"], 2, r"= 2\*3 = 6"),
    (["topology.tp=3"], 3, r"n_heads=8 is not divisible by topology.tp=3"),
    (["model.d_ff=66", "topology.tp=4"], 4, r"d_ff=66 is not divisible by topology.tp=4"),
    (["model.d_model=30"], 1, r"d_model=30 is not divisible by model.n_heads=8"),
    (["topology.tp=2", "topology.sequence_parallel=true", "train.seq_len=15"], 2,
     r"seq_len=15 is not divisible by topology.tp=2"),
    (["topology.pp=2", "model.tie_embeddings=true"], 2, r"tie_embeddings needs topology.pp=1"),
    (["topology.dp=4", "topology.ep=3"], 4, r"topology.ep=3 must divide topology.dp=4"),
    (["topology.dp=2", "topology.ep=2"], 2, r"topology.ep > 1 needs an MoE model"),
    (["model.num_experts=3", "topology.dp=2", "topology.ep=2"], 2,
     r"num_experts=3 is not divisible by topology.ep=2"),
    (["model.dtype=\"float16x\""], 1, r"model.dtype='float16x'"),
    (["schedule.kind=\"zigzag\""], 1, r"schedule.kind='zigzag'"),
    (["topology.pp=8", "schedule.kind=\"interleaved\"", "schedule.virtual_stages=2"], 8,
     r"n_layers=8 < pp\*virtual_stages = 8\*2"),
    (["optim.zero=3"], 1, r"optim.zero must be 0, 1 or 2"),
    (["topology.tp=0"], 1, r"topology.tp must be >= 1"),
    (["optim.reduction=\"ring\""], 1, r"optim.reduction='ring'; valid: bucketed, "),
    (["topology.dp=2", "optim.zero=1", "optim.reduction=\"per-parameter\""], 2,
     r"optim.reduction=per-parameter needs optim.zero=0"),
])
def test_layout_errors_show_arithmetic(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(TINY, overrides), world)


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, ["topology.tp=3", "optim.zero=5"]), 2)
    text = str(e.value)
    assert "n_heads=8" in text and "optim.zero" in text and "world has 2" in text


def test_defaults_are_a_valid_config():
    validate(Config(), 1)
