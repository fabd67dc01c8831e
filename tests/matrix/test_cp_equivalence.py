"""Invariant 1 for context parallelism in one launch (float64, 5 steps): ring
attention over ``cp_comm`` with causal load balancing trains the same model as one rank,
alone and composed with tp + sequence parallelism, pp x dp with ZeRO-3 and experts (ep). Each layout
shares a baseline other tests already run (the llama and gpt presets, the MoE reference of
``test_moe_equivalence.py``); cp=4 runs in ``test_checkpoint_reshard.py`` (cp=4 -> 1 rank,
1 rank -> Ulysses cp=4, ring cp=4 -> hybrid cp=4). ``topology.cp_kind=ulysses`` runs
composed with tp + sequence parallelism, ``hybrid`` at cp=4 (2 x 2) with tp + sequence
parallelism.
"""

import pytest
from inprocess import baseline, train_layout
from launch import TINY, TINY_GPT, assert_same

SP = "topology.sequence_parallel=true"
MOE = ("model.num_experts=4", "model.moe_every=2")  # as test_moe_equivalence.py
# Dense layouts take the global batch in fewer, larger microbatches than the reference (the
# same sum of token losses, so the same gradients to rounding): every microbatch costs
# 7 ring transfers per layer, which oversubscribed ranks pay in context switches.
WHOLE, HALF = "train.micro_batch_size=16", "train.micro_batch_size=4"

# (name, ranks, config, overrides, one-rank reference overrides)
LAYOUTS = [
    ("gpt-cp2", 2, TINY_GPT, ["topology.cp=2", WHOLE], []),
    ("cp2xtp2-sp", 4, TINY, ["topology.cp=2", "topology.tp=2", SP, WHOLE], []),
    # Ulysses: the all-to-all of heads over cp (8 query / 4 kv heads split over tp x cp)
    ("ulysses-cp2xtp2-sp", 4, TINY, ["topology.cp=2", "topology.cp_kind=ulysses",
                                     "topology.tp=2", SP, WHOLE], []),
    # hybrid: Ulysses groups of 2 cp ranks (4 query / 2 kv heads of a tp rank split over
    # them), the ring across the 2 groups, with tp + sequence parallelism
    ("hybrid-cp4x2-tp2-sp", 8, TINY, ["topology.cp=4", "topology.cp_kind=hybrid",
                                      "topology.cp_ulysses=2", "topology.tp=2", SP, WHOLE], []),
    # ... with ZeRO-3: parameters sharded over the dp x cp replicas
    ("cp2xpp2xdp2-zero3", 8, TINY, ["topology.cp=2", "topology.pp=2", "topology.dp=2", HALF,
                                    "optim.zero=3"], []),
    # The MoE reference takes the global microbatch (dp * mbs = 2 sequences) at once.
    ("cp2xep2", 4, TINY, [*MOE, "topology.cp=2", "topology.dp=2", "topology.ep=2"],
     [*MOE, "train.micro_batch_size=2"]),
]


@pytest.mark.parametrize("name,n,config,overrides,ref", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_cp_float64_equals_one_rank(tmp_path, session_dir, name, n, config, overrides, ref):
    reference = baseline(session_dir, *ref, config=config)
    run = train_layout(tmp_path / name, n, *overrides, config=config)
    assert_same(run, reference, rel=1e-9, what=name)
    # The cp transfers are recorded under their own axis (bytes: never a timing claim),
    # and the gradients of the cp replicas are summed over dp x cp.
    assert all(m["comm_bytes"].get("cp", 0) > 0 for m in run.metrics), run.metrics[0]
    assert all(m["comm_bytes"].get("dpcp", 0) > 0 for m in run.metrics), run.metrics[0]
    if "moe_load" in reference.metrics[0]:
        for a, b in zip(run.metrics, reference.metrics):
            assert a["moe_load"] == b["moe_load"]
            assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-9 * abs(b["moe_aux_loss"])
