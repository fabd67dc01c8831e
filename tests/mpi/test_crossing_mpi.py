"""benchmarks/crossing.py inside MPI ranks: its three designs (flat, hierarchical over
pretended nodes of 2 ranks, per-parameter) each sum every rank's tensor, and its rows name
each design with a time and the bytes its node sent."""

import pytest
import torch

from benchmarks.crossing import PER_PARAMETER, designs, measure, sent_bytes
from hpctrain import comm

pytestmark = pytest.mark.mpi


def test_every_design_sums_every_ranks_tensor():
    world = comm.world()
    per_node = 2 if world.size % 2 == 0 and world.size > 2 else 1
    n = 4 * PER_PARAMETER + 3  # not a multiple of the chunks or the node's ranks
    want = sum(torch.arange(n, dtype=torch.float64) * (r + 1) for r in range(world.size))
    x = torch.empty(n, dtype=torch.float64)
    for name, run in designs(world, x, node_color=world.rank // per_node).items():
        x.copy_(torch.arange(n, dtype=torch.float64) * (world.rank + 1))
        run()
        torch.testing.assert_close(x, want, rtol=1e-12, atol=0, msg=name)


def test_rows_name_each_design_with_its_time_and_bytes_sent():
    world = comm.world()
    rows = measure(world, 1 << 16, repeats=2)
    assert [r["design"] for r in rows] == ["flat", "hierarchical",
                                           f"per-parameter ({PER_PARAMETER})"]
    assert all(r["median_s"] > 0 and r["sent_bytes"] >= 0 and r["message_bytes"] == 1 << 16
               for r in rows)
    assert sent_bytes("no-such-interface") == 0
