"""DeepSeek-style experts equal one rank in one launch (float64, 1e-9): shared experts
with a gate, fine-grained experts, sigmoid scores with renormalised and scaled weights,
auxiliary-loss-free balancing (the selection bias) and group-limited routing, all on at once.

Two launches: the one-rank reference (6 steps, saving at 3) and dp=2 x ep=2 x tp=2 with ZeRO-1
and the all-to-alls overlapped in the schedule, resumed from the reference's step-3
checkpoint (which carries the selection biases): its steps 4-6, final parameters, biases and
optimizer state equal the straight run's. The one-rank reference takes the global
microbatch as its microbatch (see tests/matrix/test_moe_equivalence.py).
"""

import numpy as np
import pytest
from inprocess import baseline, train_layout
from launch import assert_tail_equal, ckpt, read_params

DEEPSEEK = ("model.num_experts=8", "model.moe_every=2", "model.top_k=3",
            "model.expert_d_ff=16", "model.shared_experts=2", "model.shared_expert_gate=true",
            "model.router_score=\"sigmoid\"", "model.norm_topk_prob=true",
            "model.routed_scaling_factor=2.5", "model.bias_update_rate=0.01",
            "model.route_groups=4", "model.route_top_groups=2", "model.aux_loss_coef=0",
            "train.steps=6", "checkpoint.every=3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, session_dir):
    ref = baseline(session_dir, *DEEPSEEK, "train.micro_batch_size=2")
    resumed = train_layout(tmp_path_factory.mktemp("deepseek") / "ep_tp", 4, *DEEPSEEK,
                        "topology.dp=2", "topology.ep=2", "topology.tp=2", "optim.zero=1",
                        "schedule.moe_overlap=true", f"checkpoint.resume={ckpt(ref, 3)}")
    return ref, resumed


def test_selection_bias_is_trained_and_checkpointed(runs):
    ref, _ = runs
    biases = {n: v for n, v in ref.params.items() if n.endswith("route_bias")}
    assert sorted(biases) == [f"model/blocks.{i}.mlp.route_bias" for i in (1, 3, 5, 7)]
    assert all(np.abs(v).max() > 0 for v in biases.values())
    at3 = read_params(ckpt(ref, 3))
    assert any(np.abs(at3[n] - v).max() > 0 for n, v in biases.items())  # still moving


def test_resumed_on_ep_tp_equals_the_straight_one_rank_run(runs):
    ref, resumed = runs
    assert_tail_equal(resumed, ref, 3, "1 rank -> dp=2 x ep=2 x tp=2, ZeRO-1, moe_overlap")
    for a, b in zip(resumed.metrics, ref.metrics[3:]):
        assert a["moe_load"] == b["moe_load"]
