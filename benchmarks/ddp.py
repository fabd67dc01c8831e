"""Data-parallel training throughput on 2 ranks: ``hpctrain train`` (dp=2, bucketed MPI
all-reduce) against PyTorch DistributedDataParallel (gloo), same model, init, data and
batch; both must reach the same losses."""

from __future__ import annotations

from .common import (
    bound_without,
    exposed_comm_s,
    hpctrain_steps,
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
    ours, theirs, comm, losses = [], [], [], {}
    for r in range(pairs_of(repeats, size)):
        sides = [("hpctrain", lambda: hpctrain_steps(cfg, world)),
                 ("torch DDP", lambda: torch_loop(cfg, world))]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            steps, loss = fn()
            if name == "hpctrain":
                ours.append(median(steady([s["step_time_s"] for s in steps])))
                comm.append(median(steady([exposed_comm_s(s) for s in steps])))
            else:
                theirs.append(median(steady(steps)))
            losses.setdefault(name, loss)
    out = result("ddp", world, size, repeats,
                 f"data-parallel step, dp={world.size}, {tokens} tokens/step")
    out["rows"] = [row("hpctrain dp (MPI, bucketed)", ours, "s/step"),
                   row("torch DDP (gloo)", theirs, "s/step")]
    out["exposed_comm"] = row("hpctrain exposed communication", comm, "s/step")
    q = ratio("throughput hpctrain / DDP", 0.0, ">= 1.15", pair_ratios(theirs, ours))
    q["why"] = bound_without(ours, theirs, comm, q,
                             "hpctrain waits for communication (against DDP):")
    out["ratios"] = [q]
    out["check"] = same_losses(losses)
    return out

