"""Framework overhead on one rank: an ``hpctrain train`` step against a plain PyTorch
training loop of the same model (torch AdamW, clip_grad_norm_), same init, data and batch."""

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
    torch_loop,
    train_config,
)

RANKS = (1,)


def run(world, size: str, repeats: int) -> dict:
    cfg = train_config(size)
    ours, theirs, losses = [], [], {}
    for r in range(pairs_of(repeats, size)):
        sides = [("hpctrain", lambda: hpctrain_run(cfg, world)),
                 ("plain PyTorch", lambda: torch_loop(cfg))]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            times, loss = fn()
            (ours if name == "hpctrain" else theirs).append(median(steady(times)))
            losses.setdefault(name, loss)
    out = result("overhead", world, size, repeats, "one-rank training step")
    out["rows"] = [row("hpctrain train", ours, "s/step"),
                   row("plain PyTorch loop", theirs, "s/step")]
    q = ratio("overhead hpctrain / plain - 1", 0.0, "<= 0.05",
              pair_ratios(ours, theirs, offset=-1.0))
    q["noise"] = q["spread"][0] <= 0.0 <= q["spread"][1]  # an overhead: 0 is "no change"
    out["ratios"] = [q]
    out["check"] = same_losses(losses)
    return out
