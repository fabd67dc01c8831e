"""Any layout restores any checkpoint (invariant 4), float64, in one launch.

Each case: the one-rank run of 6 steps straight (saving at step 3) is the reference. Layout X
trains 6 steps saving at 3 (compared with the reference too); layout Y restarts from X's
step 3 and trains 3 more. Y's losses and grad norms must equal the reference's steps 4-6 and
its final parameters *and optimizer state* the reference's, within 1e-9 relative.
"""

import json

import numpy as np
from inprocess import baseline, train_layout
from launch import assert_same, assert_tail_equal, ckpt

COMMON = ("train.steps=6", "checkpoint.every=3")


def layout(dp=1, tp=1, pp=1, ep=1):
    return (f"topology.dp={dp}", f"topology.tp={tp}", f"topology.pp={pp}", f"topology.ep={ep}")






def reshard(tmp_path, ref, save, load, extra=(), save_extra=(), load_extra=()):
    """Train on layout ``save`` (n ranks) saving at 3, restart on ``load`` from step 3."""
    n_save = np.prod([int(o.split("=")[1]) for o in save if not o.startswith("topology.ep")])
    n_load = np.prod([int(o.split("=")[1]) for o in load if not o.startswith("topology.ep")])
    if ref is None or tuple(save) != layout():
        a = train_layout(tmp_path / "save", int(n_save), *COMMON, *extra, *save, *save_extra)
        if ref is not None:
            assert_same(a, ref, rel=1e-9, what=f"straight run on {save}")
    else:
        a = ref
    b = train_layout(tmp_path / "load", int(n_load), "train.steps=6", *extra, *load, *load_extra,
                  f"checkpoint.resume={ckpt(a, 3)}")
    return a, b


def test_dp2_to_dp4_and_one_rank_reference(tmp_path, session_dir):
    # Runs now: the machinery itself (replicated writes once, reads everywhere).
    ref = baseline(session_dir, *COMMON)
    _, b = reshard(tmp_path, ref, layout(dp=2), layout(dp=4))
    assert_tail_equal(b, ref, 3, "dp=2 -> dp=4")


def test_dp4_to_dp2_tp2(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    a, b = reshard(tmp_path, ref, layout(dp=4), layout(dp=2, tp=2))
    assert_tail_equal(b, ref, 3, "dp=4 -> dp=2 x tp=2")
    recovered = [json.loads((r.run_dir / "summary.json").read_text())["recovery"] for r in (a, b)]
    assert recovered[0]["tier"] == "none" and recovered[1]["tier"] == "hdf5"
    assert recovered[1]["reshard"] and recovered[1]["step"] == 3, recovered  # another grid


def test_tp2_pp2_to_one_rank(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    _, b = reshard(tmp_path, ref, layout(tp=2, pp=2), layout())
    assert_tail_equal(b, ref, 3, "tp=2 x pp=2 -> 1 rank")


def test_one_rank_to_pp2_dp2_tp2(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    _, b = reshard(tmp_path, ref, layout(), layout(dp=2, tp=2, pp=2))
    assert_tail_equal(b, ref, 3, "1 rank -> pp=2 x dp=2 x tp=2")


def test_ep2_to_ep1(tmp_path, session_dir):
    # MoE balance statistics are per global microbatch: the one-rank runs use
    # micro_batch_size = dp * 1 so that their microbatches are the dp=2 run's (see
    # tests/matrix/test_moe_equivalence.py).
    moe, whole = ("model.num_experts=4", "model.moe_every=2"), "train.micro_batch_size=2"
    ref = baseline(session_dir, *COMMON, *moe, whole)
    _, b = reshard(tmp_path, ref, layout(dp=2, ep=2), layout(), extra=moe, load_extra=(whole,))
    assert_tail_equal(b, ref, 3, "dp=2 x ep=2 -> 1 rank (ep=1)")


def test_optimizer_state_reshard_zero(tmp_path, session_dir):
    """ZeRO-1 shards of the optimizer state over dp=4 restored as dp=2 shards; the file
    holds the global tensors, compared with the unsharded one-rank reference's."""
    ref = baseline(session_dir, *COMMON)
    _, b = reshard(tmp_path, ref, layout(dp=4), layout(dp=2), save_extra=("optim.zero=1",),
                   load_extra=("optim.zero=1",))
    assert_tail_equal(b, ref, 3, "zero=1 dp=4 -> zero=1 dp=2")


def test_cp4_to_one_rank_and_one_rank_to_cp2(tmp_path, session_dir):
    # Context parallelism: the cp=4 run itself equals the reference (ring attention over 4
    # ranks, 8 chunks of 2 tokens), its checkpoint has one writer per element although the
    # 4 cp ranks hold identical parameters, and one rank continues from it; cp=2 continues
    # from the reference's own checkpoint. The cp runs take the global batch as one
    # microbatch (the same gradients; 16x fewer ring transfers).
    whole = ("train.micro_batch_size=16",)
    ref = baseline(session_dir, *COMMON)
    a, b = reshard(tmp_path, ref, ("topology.cp=4",), layout(), save_extra=whole)
    assert_tail_equal(b, ref, 3, "cp=4 -> 1 rank")
    _, c = reshard(tmp_path / "back", ref, layout(), ("topology.cp=2",), load_extra=whole)
    assert_tail_equal(c, ref, 3, "1 rank -> cp=2")
    # The ring cp=4's checkpoint continues as the hybrid: 2 Ulysses groups of 2 cp ranks,
    # the ring across them (the same token layout, the same file).
    h = train_layout(tmp_path / "hybrid", 4, "train.steps=6", "topology.cp=4", *whole,
                  "topology.cp_kind=hybrid", "topology.cp_ulysses=2",
                  f"checkpoint.resume={ckpt(a, 3)}")
    assert_tail_equal(h, ref, 3, "ring cp=4 -> hybrid cp=4 (2x2)")


def test_one_rank_to_ulysses_cp4(tmp_path, session_dir):
    # Checkpoints do not depend on the kind of context parallelism (a ring run writes the
    # reference's file, test_cp4_to_one_rank_and_one_rank_to_cp2): the reference's own
    # checkpoint continues as Ulysses over 4 ranks (2 of the 8 query and 1 of the 4 kv
    # heads per cp rank), one launch.
    whole = ("train.micro_batch_size=16",)
    ref = baseline(session_dir, *COMMON)
    _, b = reshard(tmp_path, ref, layout(), ("topology.cp=4",),
                   load_extra=(*whole, "topology.cp_kind=ulysses"))
    assert_tail_equal(b, ref, 3, "1 rank -> ulysses cp=4")
