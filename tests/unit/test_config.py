"""Config parsing, overrides and every validation error, without MPI."""

from dataclasses import replace

import pytest

from hpctrain.checks.validate import validate
from hpctrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    dumps_toml,
    from_dict,
    load,
    microbatches,
    parse_override,
)

TINY = "share/configs/tiny.toml"
TINY_LLAMA = "share/configs/tiny-llama.toml"


def test_presets_load_and_validate():
    cfg = load(TINY)
    assert cfg.model.n_layers == 8 and cfg.model.n_heads == 8 and cfg.model.dtype == "float64"
    validate(cfg, 1)
    demo = load("share/configs/demo.toml")
    validate(demo, 4)
    assert microbatches(demo) == 16 // (4 * 2)


@pytest.mark.parametrize("preset,tps", [(TINY, (1, 2, 4, 8)), (TINY_LLAMA, (1, 2, 4))])
def test_every_layout_up_to_8_ranks_divides_tiny(preset, tps):
    for dp in (1, 2, 4, 8):
        for tp in tps:  # tiny-llama: tp must divide its 4 kv heads
            for pp in (1, 2, 4, 8):
                n = dp * tp * pp
                if n <= 8:
                    cfg = load(preset, [f"topology.dp={dp}", f"topology.tp={tp}",
                                        f"topology.pp={pp}"])
                    validate(cfg, n)


def test_tiny_llama_is_the_llama_twin_of_tiny():
    gpt, llama = load(TINY).model, load(TINY_LLAMA).model
    assert gpt.arch == "gpt" and llama.arch == "llama" and llama.kv_heads == 4
    assert replace(llama, arch="gpt", n_kv_heads=0) == gpt
    assert load(TINY_LLAMA).train == load(TINY).train


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
    (["model.dtype=true"], "model.dtype must be a string"),  # a number reads as its text
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
    (["optim.zero=4"], 1, r"optim.zero=4 must be 0, 1, 2 or 3"),
    (["topology.dp=2", "optim.zero=3", "model.recompute=true"], 2,
     r"optim.zero=3 cannot be combined with model.recompute"),
    (["topology.dp=2", "topology.ep=2", "model.num_experts=4", "optim.zero=3",
      "schedule.moe_overlap=true"], 2, r"optim.zero=3 cannot be combined with schedule.moe_o"),
    (['model.arch="llama"', "model.n_kv_heads=2", "topology.tp=4"], 4,
     r"model.n_kv_heads=2 is not divisible by topology.tp=4 \(each tp rank holds whole kv"),
    (['model.arch="llama"', "model.n_kv_heads=3"], 1,
     r"model.n_heads=8 is not divisible by model.n_kv_heads=3"),
    (['model.arch="llama"', "model.d_model=24"], 1,
     r"model.d_model/model.n_heads = 24/8 = 3 must be even for the llama family"),
    (["model.n_kv_heads=4"], 1, r"model.n_kv_heads=4 needs model.family='llama'"),
    (['model.arch="mamba"'], 1, r"model.arch='mamba'; valid: gpt, llama"),
    (["topology.tp=0"], 1, r"topology.tp=0 must be >= 1"),
    (['model.recompute="attention"'], 1,
     r"model.recompute='attention'; valid: none, selective, full"),
    (["experimental.reduction=\"ring\""], 1, r"experimental.reduction='ring'; valid: bucketed, "),
    (["optim.overlap_progress=\"spin\""], 1,
     r"optim.overlap_progress='spin'; valid: auto, test, thread, poll, wait"),
    (["topology.dp=2", "optim.zero=1", "experimental.reduction=\"per-parameter\""], 2,
     r"experimental.reduction=per-parameter needs optim.zero=0"),
])
def test_layout_errors_show_arithmetic(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(TINY, overrides), world)


def test_recompute_boolean_form_reads_as_full_or_none():
    """``model.recompute = true/false`` (TOML, --set, the Python API) means full / none;
    selective recompute combines with ZeRO-3, which full recompute does not."""
    assert load(TINY, ["model.recompute=true"]).model.recompute == "full"
    assert load(TINY, ['model.recompute="false"']).model.recompute == "none"
    assert load(TINY, []).model.recompute == "none"
    assert ModelConfig(recompute=True).recompute == "full"
    validate(load(TINY, ["topology.dp=2", "optim.zero=3", 'model.recompute="selective"']), 2)


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, ["topology.tp=3", "optim.zero=5"]), 2)
    text = str(e.value)
    assert "n_heads=8" in text and "optim.zero" in text and "world has 2" in text


def test_defaults_are_a_valid_config():
    validate(Config(), 1)


# Values that are accepted by the types but cannot mean anything: each is refused before any
# collective with the key, the value and the rule (each case alone on an otherwise valid
# config, so the message is the only error).
@pytest.mark.parametrize("overrides,message", [
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be >= 0"),
    (["optim.beta1=1.0"], "optim.beta1=1.0 must be in [0, 1)"),
    (["optim.beta1=-0.5"], "optim.beta1=-0.5 must be in [0, 1)"),
    (["optim.beta2=1.5"], "optim.beta2=1.5 must be in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (["optim.eps=-1e-8"], "optim.eps=-1e-08 must be > 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be >= 0"),
    (["optim.decay_steps=-5"], "optim.decay_steps=-5 must be >= 0"),
    (["optim.grad_clip=-1"], "optim.grad_clip=-1.0 must be >= 0"),
    (["optim.loss_scale=-2"], "optim.loss_scale=-2.0 must be > 0"),
    (["optim.min_lr=0.5"], "optim.min_lr=0.5 must be <= optim.lr=0.002"),
    (["optim.min_lr=-1e-4"], "optim.min_lr=-0.0001 must be >= 0"),
    (["model.d_ff=-64"], "model.d_ff=-64 must be >= 0"),
    (["model.init_std=-0.02"], "model.init_std=-0.02 must be >= 0"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 must be > 0"),
    (["model.norm_eps=-1e-5"], "model.norm_eps=-1e-05 must be > 0"),
    (["model.num_experts=-1"], "model.num_experts=-1 must be >= 0"),
    (["model.num_experts=4", "model.capacity_factor=-1"],
     "model.capacity_factor=-1.0 must be >= 0"),
    (["model.num_experts=4", "model.moe_every=9"],
     "model.moe_every=9 > model.n_layers=8: no layer would have experts"),
    (["model.num_experts=4", "model.aux_loss_coef=-1"], "model.aux_loss_coef=-1.0 must be >= 0"),
    (["model.num_experts=4", "model.z_loss_coef=-1"], "model.z_loss_coef=-1.0 must be >= 0"),
    (["model.num_experts=4", "model.top_k=5"], "model.top_k=5 must be >= 1 and <="),
    (["model.num_experts=4", "model.route_groups=3"],
     "model.route_groups=3 does not divide model.num_experts=4"),
    (["model.num_experts=4", "model.route_groups=2", "model.route_top_groups=3"],
     "model.route_top_groups=3 > model.route_groups=2"),
    (["model.num_experts=8", "model.top_k=3", "model.route_groups=4", "model.route_top_groups=1"],
     "model.top_k=3 > the 2 experts of the model.route_top_groups=1 groups of 2"),
    (["model.num_experts=4", "model.shared_expert_gate=true"],
     "model.shared_expert_d_ff and model.shared_expert_gate need model.shared_experts > 0"),
    (["data.corpus_mb=-1"], "data.corpus_mb=-1.0 must be > 0"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 must be in [0, 1)"),
    (['data.path="d.h5"', 'data.tokenizer="t.json"'],
     "data.tokenizer='t.json' tokenizes the embedded corpus, but data.path='d.h5' is a "
     "prepared file that carries its own tokenizer"),
    (["schedule.virtual_stages=2"],
     "schedule.virtual_stages=2 is used only by schedule.kind='interleaved'"),
    (["schedule.kind=\"zb-h1\"", "schedule.virtual_stages=4"],
     "schedule.virtual_stages=4 is used only by schedule.kind='interleaved', not 'zb-h1'"),
    (["train.log_every=-1"], "train.log_every=-1 must be >= 0"),
    (["train.max_wall_s=-1"], "train.max_wall_s=-1.0 must be >= 0"),
    (["train.slurm_margin_s=-1"], "train.slurm_margin_s=-1.0 must be >= 0"),
    (["train.seed=-1"], "train.seed=-1 must be in [0, 2**63)"),
    (["train.seed=9223372036854775808"], "train.seed must be a 64-bit integer, got 922337"),
    (["model.d_model=1e400"], "model.d_model must be an integer"),
    (["optim.lr=1" + "0" * 400], "optim.lr must be a finite number"),
    (["train.eval_every=1", "train.target_val_loss=-1"],
     "train.target_val_loss=-1.0 must be >= 0"),
    (["checkpoint.keep=-1"], "checkpoint.keep=-1 must be >= 0"),
    (["checkpoint.every=-2"], "checkpoint.every=-2 must be >= 0"),
    (["checkpoint.alignment=-4096"], "checkpoint.alignment=-4096 must be >= 0"),
    (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    (["model.rope_theta=0"], "model.rope_theta=0.0 must be > 0"),
    (["model.n_kv_heads=-1"], "model.n_kv_heads=-1 must be >= 0"),
    (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["data.corpus_mb=-inf"], "data.corpus_mb must be a finite number, got -inf"),
])
def test_values_that_cannot_mean_anything(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, overrides), 1)
    assert message in str(e.value), str(e.value)


def test_holes_are_reported_together_with_the_rest():
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, ["optim.lr=-1", "optim.eps=0", "model.norm_eps=0",
                             "topology.tp=3"]), 2)
    text = str(e.value)
    for part in ("optim.lr=-1.0 must be >= 0", "optim.eps=0.0 must be > 0",
                 "model.norm_eps=0.0 must be > 0", "n_heads=8", "world has 2"):
        assert part in text, text


@pytest.mark.parametrize("overrides", [
    ["optim.lr=0", "optim.min_lr=0"],  # a frozen model is a legal (if useless) run
    ["optim.beta1=0", "optim.beta2=0"],
    ["model.d_ff=0"],  # 0: 4 * d_model
    ["model.n_kv_heads=8"],  # gpt: as many kv heads as query heads, said explicitly
    ['model.arch="llama"', "model.n_kv_heads=1"],  # multi-query attention
    ['model.arch="llama"', "model.n_kv_heads=0"],  # 0: n_heads
    ["model.num_experts=4", "model.moe_every=8"],  # one expert layer, the last
    ["model.num_experts=0", "model.moe_every=99"],  # ignored by a dense model
    ["checkpoint.keep=0"],  # keep every checkpoint
    ["train.log_every=0"],  # treated as 1
    ["topology.pp=2", "schedule.kind=\"interleaved\"", "schedule.virtual_stages=2"],
])
def test_edges_that_stay_valid(overrides):
    validate(load(TINY, overrides), 2 if "topology.pp=2" in overrides else 1)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "zbv"])
def test_zero3_runs_every_pipeline_schedule(kind):
    """ZeRO-3 steers the split backward's B too (parallel/grad_sync/sharded.py)."""
    validate(load(TINY, ["topology.dp=2", "topology.pp=2", "optim.zero=3",
                         f'schedule.kind="{kind}"']), 4)
