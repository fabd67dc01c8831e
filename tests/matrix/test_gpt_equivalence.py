"""Invariant 1 for the gpt form (``model.arch = "gpt"``: GELU MLP, multi-head attention,
no positions; share/configs/tiny.toml), a smoke set in one launch. The layout tests
(test_dp/tp/pp/moe_equivalence.py, test_zero.py, test_checkpoint_reshard.py) run the llama
form (tests/launch.py ``TINY``); these keep the gpt path covered in two launches: tp with
sequence parallelism composed with a pipeline schedule, and dp with experts (top-2)."""

from inprocess import baseline, train_layout
from launch import TINY_GPT, assert_same

SP = "topology.sequence_parallel=true"
MOE = ("model.num_experts=4", "model.moe_every=2", "model.top_k=2")


def test_gpt_tp_sp_pipeline_equals_one_rank(tmp_path, session_dir):
    """tp=2 with sequence parallelism x pp=2 (1F1B): the gpt attention and MLP split over
    tp, sequence slices between blocks, activations between stages. (The CI machine is
    small: one launch for three kinds of parallelism.)"""
    ref = baseline(session_dir, config=TINY_GPT)
    assert "model/blocks.0.mlp.w3" not in ref.params  # the GELU MLP, not SwiGLU
    run = train_layout(tmp_path / "tp2-sp-pp2", 4, "topology.tp=2", SP, "topology.pp=2",
                    'schedule.kind="1f1b"', config=TINY_GPT)
    assert_same(run, ref, rel=1e-9, what="gpt tp=2 sp pp=2")


def test_gpt_experts_equal_one_rank(tmp_path, session_dir):
    """dp=2 with ep=2, the gpt routing (top-2 renormalised) and GELU experts."""
    # The one-rank reference takes the global microbatch (dp * mbs = 2 sequences) at once.
    ref = baseline(session_dir, *MOE, "train.micro_batch_size=2", config=TINY_GPT)
    run = train_layout(tmp_path / "ep2", 2, *MOE, "topology.dp=2", "topology.ep=2",
                    config=TINY_GPT)
    assert_same(run, ref, rel=1e-9, what="gpt dp=2 ep=2 top-2")
    for a, b in zip(run.metrics, ref.metrics):
        assert a["moe_load"] == b["moe_load"]
