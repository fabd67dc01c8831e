"""The DeepSeek-V3 family equals one rank in one launch (float64, 1e-9, 3 steps): multi-head
latent attention (query compression, the shared rotary key, values narrower than keys) with
DeepSeek-V3's experts (the first block dense, sigmoid scores, the selection bias moving,
group-limited routing, a shared expert) on layouts that split it every way: heads over tp with
sequence parallelism and pp; the zero-bubble schedule's deferred weight gradients over pp with
ZeRO-1; and with two multi-token-prediction modules (their targets cut at each cp rank's
positions) ring attention over cp with experts over ep, Ulysses over cp with tp and sequence
parallelism, the hybrid of both over cp=4. The one-rank reference takes the global
microbatch as its microbatch (tests/matrix/test_moe_equivalence.py). Transformers' logits and
generation:
tests/e2e/test_hf_deepseek.py; the modules' objective: tests/unit/test_mtp.py."""

import numpy as np
import pytest
from inprocess import baseline, train_layout
from launch import assert_same

DEEPSEEK_V3 = ("model.family=\"deepseek_v3\"", "model.n_kv_heads=0", "model.n_layers=4",
               "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_dim=8",
               "model.qk_rope_dim=4", "model.v_head_dim=6", "model.num_experts=8",
               "model.top_k=2", "model.dense_layers=1", "model.expert_d_ff=16",
               "model.shared_experts=1", "model.router_score=\"sigmoid\"",
               "model.route_groups=4", "model.route_top_groups=2", "model.norm_topk_prob=true",
               "model.routed_scaling_factor=2.5", "model.bias_update_rate=0.01",
               "model.aux_loss_coef=0", "train.steps=3")
MB2 = "train.micro_batch_size=2"
SP = "topology.sequence_parallel=true"

MTP = "model.mtp_depth=2"

LAYOUTS = [
    ("tp2xpp2-sp", [], ["topology.tp=2", "topology.pp=2", SP, MB2]),
    ("pp2-zbv-dp2-zero1", [], ["topology.pp=2", "topology.dp=2", "schedule.kind=\"zbv\"",
                               "optim.zero=1"]),
    ("mtp-cp2-ring-ep2", [MTP], ["topology.cp=2", "topology.dp=2", "topology.ep=2"]),
    ("mtp-cp2-ulysses-tp2-sp", [MTP], ["topology.cp=2", "topology.cp_kind=ulysses",
                                       "topology.tp=2", SP, MB2]),
    # hybrid: Ulysses groups of 2 cp ranks, the ring across the 2 groups
    ("mtp-cp4-hybrid", [MTP], ["topology.cp=4", "topology.cp_kind=hybrid",
                               "topology.cp_ulysses=2", MB2]),
]


@pytest.mark.parametrize("name,mtp,layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_deepseek_v3_equals_one_rank(tmp_path, session_dir, name, mtp, layout):
    reference = baseline(session_dir, *DEEPSEEK_V3, *mtp, MB2)
    run = train_layout(tmp_path / name, 4, *DEEPSEEK_V3, *mtp, *layout)
    assert_same(run, reference, rel=1e-9, what=name)
    biases = [n for n in run.params if n.endswith("mlp.route_bias")]
    blocks = (1, 2, 3, 4, 5) if mtp else (1, 2, 3)  # the modules' blocks follow the model's
    assert sorted(biases) == [f"model/blocks.{i}.mlp.route_bias" for i in blocks]
    assert all(np.abs(run.params[n]).max() > 0 for n in biases)  # the bias moved
    for a, b in zip(run.metrics, reference.metrics):
        assert a["moe_load"] == b["moe_load"]
