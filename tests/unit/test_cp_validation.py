"""Context parallelism (``topology.cp``) before any collective: the layout arithmetic, the
sequence cut into 2*cp chunks, the refused combinations; the sampler's slices; the plan."""

from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import fake_topology

from hpctrain.checks.validate import validate
from hpctrain.config import ConfigError, load
from hpctrain.data.dataset import Sampler, context_positions
from hpctrain.planner.memory import estimate
from hpctrain.telemetry.watchdog import peer_coords
from hpctrain.topology import Coords, crossing

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "share/configs/tiny-llama.toml")  # seq_len 16
MOE = ["model.num_experts=4", "topology.dp=2", "topology.ep=2"]


@pytest.mark.parametrize("overrides,world,message", [
    (["topology.cp=2"], 4, "layout dp*cp*tp*pp = 1*2*1*1 = 2 but the world has 4 ranks; "
     "set topology.dp/cp/tp/pp so that the product is 4"),
    (["topology.cp=0"], 1, "topology.cp=0 must be >= 1"),
    (["topology.cp=3"], 3, "train.seq_len=16 is not divisible by 2*topology.cp = 6"),
    (["topology.cp=4", "topology.tp=2", "topology.sequence_parallel=true", "train.seq_len=20"],
     8, "train.seq_len=20 is not divisible by 2*topology.cp = 8"),
    (["topology.cp=2", "topology.tp=4", "topology.sequence_parallel=true", "train.seq_len=20"],
     8, "train.seq_len=20 is not divisible by topology.cp*tp = 2*4"),
    ([*MOE, "topology.cp=2", "model.capacity_factor=1.0"], 4,
     "model.capacity_factor=1.0 needs topology.cp=1"),
    ([*MOE, "topology.cp=2", "schedule.moe_overlap=true"], 4,
     "schedule.moe_overlap needs topology.cp=1"),
    # Ulysses: tiny-llama's 8 query / 4 kv heads split over tp x cp
    (["topology.cp=4", "topology.tp=2", "topology.cp_kind=ulysses"], 8,
     "topology.cp_kind=\"ulysses\": key/value heads=4 is not divisible by topology.tp*cp = 2*4"),
    (["topology.cp=2", "topology.cp_kind=ulysses", "model.n_heads=9", "model.n_kv_heads=3",
      "model.d_model=72"], 2,
     "topology.cp_kind=\"ulysses\": model.n_heads=9 is not divisible by topology.tp*cp = 1*2"),
    # hybrid: tiny-llama's heads split over tp x cp_ulysses; cp_ulysses divides cp
    (["topology.cp=4", "topology.tp=2", "topology.cp_kind=hybrid", "topology.cp_ulysses=4"],
     8, "topology.cp_kind=\"hybrid\": key/value heads=4 is not divisible by "
        "topology.tp*cp_ulysses = 2*4"),
    (["topology.cp=4", "topology.cp_kind=hybrid", "topology.cp_ulysses=3"], 4,
     "topology.cp_ulysses=3 does not divide topology.cp=4"),
    (["topology.cp=2", "topology.cp_ulysses=2"], 2,
     "topology.cp_ulysses=2 applies to topology.cp_kind=\"hybrid\" only"),
    (["topology.cp_kind=hybrid", "topology.cp_ulysses=2"], 1,
     "topology.cp_ulysses=2 exceeds topology.cp=1"),
    (["topology.cp=2", "topology.cp_kind=zigzag"], 2, "topology.cp_kind"),
])
def test_cp_errors(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, overrides), world)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides,world", [
    (["topology.cp=2"], 2), (["topology.cp=8"], 8),
    (["topology.cp=2", "topology.tp=2", "topology.sequence_parallel=true"], 4),
    (["topology.cp=2", "topology.pp=2", "topology.dp=2"], 8),
    ([*MOE, "topology.cp=2"], 4),
    (["topology.cp=4", "topology.cp_kind=hybrid"], 4),
    (["topology.cp=4", "topology.tp=2", "topology.cp_kind=hybrid", "topology.cp_ulysses=2"], 8),
])
def test_cp_layouts_accepted(overrides, world):
    validate(load(TINY, overrides), world)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_ranks_share_samples_and_tile_the_sequence(cp):
    tokens = np.arange(5000, dtype=np.int64) % 251
    G, T = 8, 16
    whole = Sampler(tokens, T, G, 1, 2, 1, seed=3).local(step=4)
    parts = [Sampler(tokens, T, G, 1, 2, 1, seed=3, cp_size=cp, cp_rank=r).local(step=4)
             for r in range(cp)]
    for j, (x, y) in enumerate(whole):
        got_x, got_y = torch.zeros_like(x), torch.zeros_like(y)
        for r in range(cp):
            pos = torch.from_numpy(context_positions(T, cp, r))
            px, py = parts[r][j]
            assert px.shape == (1, T // cp)
            got_x[:, pos], got_y[:, pos] = px, py
        assert torch.equal(got_x, x) and torch.equal(got_y, y)


def test_causal_load_balance():
    # rank r holds chunks r and 2cp-1-r: the causal attention work (keys at or before each
    # query) is the same on every rank.
    for cp in (2, 4, 8):
        work = [int(sum(p + 1 for p in context_positions(64, cp, r))) for r in range(cp)]
        assert len(set(work)) == 1, work


def test_plan_activations_shrink_with_cp():
    acts = [estimate(load(TINY, [f"topology.cp={cp}"])).activations for cp in (1, 2, 4)]
    assert acts[1] < 0.6 * acts[0] and acts[2] < 0.6 * acts[1], acts
    e = estimate(load(TINY, ["topology.cp=2"]))
    assert e.comm["cp"] > 0 and e.comm["dp"] > 0  # the cp replicas' gradients are summed


def test_cp_placement_and_peer_names():
    t = load(TINY, ["topology.cp=2", "topology.tp=2", "topology.dp=2"]).topology
    # tp fastest, cp next: 4 ranks per node keep tp and cp inside, dp crosses
    cross = crossing(t, 2, 4)
    assert cross["tp"][0] == 0 and cross["cp"][0] == 0 and cross["dp"][0] == 4
    topo = fake_topology(coords=Coords(0, 1, 0, 1, 0), cp_size=2)
    assert peer_coords(topo, "cp", 0) == "(pp=0, dp=1, ep=0, tp=0)"
    assert peer_coords(topo, "dpcp", 1) == "(pp=0, dp=0, ep=0, cp=1, tp=0)"
