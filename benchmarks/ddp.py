"""Data-parallel training throughput on 2 ranks: ``hpctrain train`` (dp=2, bucketed MPI
all-reduce) against PyTorch DistributedDataParallel (gloo), same model, init, data and
batch; both must reach the same losses."""

from __future__ import annotations

from .common import (
    hpctrain_run,
    median,
    pair_ratios,
    pairs_of,
    ratio,
    result,
    row,
    same_losses,
    steady,
    torch_dist,
    torch_loop,
    train_config,
)

RANKS = (2,)


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world``; alternates the two sides ``repeats`` times."""
    cfg = train_config(size, f"topology.dp={world.size}")
    torch_dist(world)
    t = cfg.train
    tokens = t.global_batch_size * t.seq_len
    ours, theirs, losses = [], [], {}
    for r in range(pairs_of(repeats, size)):
        sides = [("hpctrain", lambda: hpctrain_run(cfg, world)),
                 ("torch DDP", lambda: torch_loop(cfg, world))]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            times, loss = fn()
            (ours if name == "hpctrain" else theirs).append(median(steady(times)))
            losses.setdefault(name, loss)
    out = result("ddp", world, size, repeats,
                 f"data-parallel step, dp={world.size}, {tokens} tokens/step")
    out["rows"] = [row("hpctrain dp (MPI, bucketed)", ours, "s/step"),
                   row("torch DDP (gloo)", theirs, "s/step")]
    out["ratios"] = [ratio("throughput hpctrain / DDP", 0.0, ">= 1.1",
                           pair_ratios(theirs, ours))]
    out["check"] = same_losses(losses)
    return out
