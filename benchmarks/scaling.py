""""Just add devices": the same model and global batch at 1, 2 and 4 ranks (dp), trained by
``hpctrain.train.train`` with the naive design (one blocking all-reduce per parameter, no
overlap, ``placement=naive``) and with hpctrain's defaults (blocking bucketed reduction,
overlapped with backward where dp crosses nodes, ``placement=auto``), interleaved run by run.

Each world size is its own launch; :func:`combine` (called by the driver once every size
has run) adds the throughput table and the strong-scaling efficiency
``throughput(n) / (n * throughput(1))`` of both designs.
"""

from __future__ import annotations

import os

from .common import (
    hpctrain_run,
    interleaved,
    median,
    pair_ratios,
    pairs_of,
    ratio,
    result,
    row,
    same_losses,
    steady,
    train_config,
)

RANKS = (1, 2, 4)
DESIGNS = {
    "naive (per-parameter, blocking, placement naive)": [
        'experimental.reduction="per-parameter"', "optim.overlap=false",
        'experimental.placement="naive"'],
    "hpctrain (bucketed, overlap across nodes, placement auto)": [
        'experimental.reduction="bucketed"', "optim.overlap=false",
        "optim.overlap_across_nodes=true",
        'experimental.placement="auto"'],
}
NAIVE, OURS = list(DESIGNS)


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world``: both designs at dp = world size, interleaved."""
    cfgs = {n: train_config(size, f"topology.dp={world.size}", *o) for n, o in DESIGNS.items()}
    losses: dict[str, list] = {}

    def side(name):
        def once():
            times, loss = hpctrain_run(cfgs[name], world)
            losses.setdefault(name, loss)
            return median(steady(times))
        return once

    samples = interleaved({n: side(n) for n in DESIGNS}, pairs_of(repeats, size))
    t = cfgs[OURS].train
    tokens = t.global_batch_size * t.seq_len
    out = result("scaling", world, size, repeats,
                 f"same model and global batch ({tokens} tokens/step) at dp={world.size}")
    out["rows"] = [row(n, v, "s/step") for n, v in samples.items()]
    out["ratios"] = [ratio("throughput hpctrain / naive", 0.0, ">= 1.0",
                           pair_ratios(samples[NAIVE], samples[OURS]))]
    out["table"] = [{"design": n, "ranks": world.size, "tokens_per_s": tokens / median(v),
                     "samples_tokens_per_s": [tokens / x for x in v]}
                    for n, v in samples.items()]
    out["check"] = same_losses(losses)
    return out


def combine(results: list[dict]) -> None:
    """Add each design's scaling efficiency from 1 rank to every larger world size to that
    size's result (in place), with the spread of the per-sample efficiencies."""
    runs = {r["ranks"]: r for r in results if r.get("bench") == "scaling" and "error" not in r}
    if 1 not in runs:
        return
    base = {t["design"]: t for t in runs[1]["table"]}
    for n, res in sorted(runs.items()):
        for t in res["table"]:
            one = base[t["design"]]
            t["efficiency"] = t["tokens_per_s"] / (n * one["tokens_per_s"])  # of medians
            effs = [x / (n * y) for x, y in zip(t["samples_tokens_per_s"],
                                                 one["samples_tokens_per_s"])]
            if n > 1:
                q = ratio(f"efficiency 1->{n} ranks, {t['design'].split()[0]}",
                          t["efficiency"], ">= 0.5")
                # the spread of per-sample efficiencies (k-th sample at n over k-th at 1);
                # an efficiency, not an A/B ratio: 1.0 is not "no change"
                q.update(spread=[min(effs), max(effs)], pairs=len(effs), noise=False)
                cores = os.cpu_count() or 1
                if not q["met"] and n > cores:
                    q["why"] = (f"{n} ranks share {cores} cores: one node of this machine "
                                f"caps the efficiency at {cores / n:.2f}")
                res["ratios"].append(q)
        res["notes"] += [f"{t['design']}: {t['tokens_per_s']:.0f} tokens/s, efficiency "
                         f"{t['efficiency']:.2f} vs 1 rank" for t in res["table"]]
