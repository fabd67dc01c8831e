"""Pipeline training throughput at pp=2 and pp=4: ``hpctrain train`` with
``schedule.kind=1f1b`` against ``torch.distributed.pipelining.Schedule1F1B`` (gloo), same
split of layers (``pipeline.placement.partition``), init, data and microbatches; same losses
required. At pp=4 also hpctrain's zb-h1, zbv and dualpipev against its 1f1b (and dualpipev
against zbv) in the same rounds, beside
the cost of their split backward (B and W of one stage against one backward, rank 0 alone).
At both sizes the measured 1f1b bubble against the simulator's (``pp_bubble`` /
``pp_bubble_sim`` of metrics.jsonl)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from hpctrain.data.dataset import Sampler, load_tokens
from hpctrain.model import DecoderStage, init_parameters, weight_grad
from hpctrain.model.stage import DTYPES
from hpctrain.optim import lr_at
from hpctrain.pipeline.placement import partition
from hpctrain.pipeline.runner import input_grad

from .abtest import interleave, loadavg, paired
from .common import (
    bound_without,
    hpctrain_run,
    median,
    pairs_of,
    result,
    row,
    same_losses,
    steady,
    torch_dist,
    torch_optimizer,
    train_config,
)

RANKS = (2, 4)
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")  # at pp=4, beside 1f1b


class _Logits(torch.nn.Module):
    """The last stage for torch pipelining: blocks, final norm and head -> logits
    (B, T, V); the loss is the schedule's ``loss_fn`` (torch keeps them apart)."""

    def __init__(self, stage: DecoderStage):
        super().__init__()
        self.stage = stage

    def forward(self, x):  # (B, T, C) -> (B, T, V)
        s = self.stage
        for block in s.blocks.values():
            x = block(x)
        return F.linear(s.norm_f(x), s.head)


def torch_pipeline(cfg, world) -> tuple[list[float], list[float]]:
    """The same training as hpctrain pp=2 with torch's Schedule1F1B. Collective (gloo)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist = torch_dist(world)
    t, o = cfg.train, cfg.optim
    rank, pp = world.rank, world.size
    ranges = partition(cfg.model.n_layers, pp)
    stage = DecoderStage(cfg.model, ranges[rank], first=rank == 0, last=rank == pp - 1)
    init_parameters([stage], t.seed)  # same names, same per-name seeds as hpctrain
    params = list(stage.parameters())
    module = _Logits(stage) if stage.last else stage
    global_tokens = t.global_batch_size * t.seq_len
    V = cfg.model.vocab_size

    def loss_fn(logits, y):  # sum of token losses / global tokens, as hpctrain scales
        return F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1),
                               reduction="sum") / global_tokens

    n_mb = t.global_batch_size // t.micro_batch_size
    pstage = PipelineStage(module, rank, pp, torch.device("cpu"))
    sched = Schedule1F1B(pstage, n_mb, loss_fn=loss_fn, scale_grads=False)
    opt = torch_optimizer(params, o)
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                      1, 0, t.seed)
    times, losses = [], []
    for step in range(t.steps):
        t0 = time.perf_counter()
        x, y = sampler.global_batch(step)  # (G, T); the schedule splits it in n_mb chunks
        opt.zero_grad(set_to_none=False)
        out: list = []
        if stage.first:
            sched.step(x)
        else:
            sched.step(target=y, losses=out)
        sq = torch.zeros(1, dtype=torch.float64)
        for p in params:
            sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if norm > o.grad_clip:
            for p in params:
                p.grad.mul_(o.grad_clip / (norm + 1e-6))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, t.steps)
        opt.step()
        loss = torch.tensor([sum(float(v.detach()) for v in out)], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(float(loss[0]))
        times.append(time.perf_counter() - t0)
    return times, losses


def split_cost(cfg, rounds: int) -> list[dict]:
    """B/backward and W/backward of a split backward on one pp=``cfg.topology.pp`` middle
    stage of ``cfg`` (one process, one microbatch): one plain backward and one B + W in turns,
    ``rounds`` pairs after a warm-up; medians of the per-pair ratios, and ``extra_s``: the
    seconds B + W takes beyond one backward (median)."""
    ranges = partition(cfg.model.n_layers, cfg.topology.pp)
    stage = DecoderStage(cfg.model, ranges[1], first=False, last=False)
    init_parameters([stage], cfg.train.seed)
    dtype = DTYPES[cfg.model.dtype]
    shape = (cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.d_model)
    g = torch.Generator().manual_seed(0)
    x0, dy = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(2))
    back, b_pass, w_pass = [], [], []
    for _ in range(rounds + 1):
        for split in (False, True):
            with weight_grad.armed(split):
                x = x0.clone().requires_grad_(True)
                out = stage(x)
                t0 = time.perf_counter()
                if not split:
                    torch.autograd.backward(out, dy)
                    back.append(time.perf_counter() - t0)
                    continue
                _, pending = input_grad(out, dy, x)
                t1 = time.perf_counter()
                pending.apply()
                b_pass.append(t1 - t0)
                w_pass.append(time.perf_counter() - t1)
    back, b_pass, w_pass = back[1:], b_pass[1:], w_pass[1:]  # without the warm-up
    both = [b + w for b, w in zip(b_pass, w_pass)]
    return {"B": median([b / a for b, a in zip(b_pass, back)]),
            "W": median([w / a for w, a in zip(w_pass, back)]),
            "B+W": median([b / a for b, a in zip(both, back)]),
            "extra_s": median(both) - median(back), "pairs": rounds}


def _alone(world, fn):
    """``fn()`` on rank 0 while the other ranks wait without spinning; its result on rank
    0 (None elsewhere). Collective over ``world``."""
    flag = torch.zeros(1)
    if world.rank == 0:
        out = fn()
        for r in range(1, world.size):
            world.isend(flag, r, 7).wait()
        return out
    world.irecv(flag, 0, 7).wait_yielding(max_sleep_s=0.01)
    return None


def run_1f1b(cfg, world, bubble: dict):
    """hpctrain's 1f1b side: (step times, losses) of one run; appends the run's median
    bubble, simulated bubble and waits (busiest rank, mean over ranks) to ``bubble``."""
    extra = {k: None for k in ("pp_bubble", "pp_bubble_sim", "pp_idle_s")}
    times, loss = hpctrain_run(cfg, world, extra)
    idle = [x for x in extra.pop("pp_idle_s") if x]
    extra["pp_idle_s"] = [min(x) for x in idle]
    extra["idle_mean"] = [sum(x) / len(x) for x in idle]
    for k, v in extra.items():
        v = [x for x in steady(v) if x is not None]
        bubble[k].append(median(v) if v else None)
    return times, loss


def split_measured(world, cfg, rounds: int, notes: list) -> dict:
    """What the zero-bubble ratios pay for their split backward (:func:`split_cost` on rank
    0 alone, pairs of a few ms each: 4x the rounds), on every rank, noted. Collective."""
    split = world.bcast_obj(_alone(world, lambda: split_cost(cfg, 4 * rounds)))
    notes.append(f"split backward of one stage, {split['pairs']} pairs: B {split['B']:.3g}, "
                 f"W {split['W']:.3g}, B + W {split['B+W']:.3g} of one backward")
    return split


def bubble_ratio(bubbles: list, sims: list) -> dict | None:
    """The measured 1f1b bubble against the simulator's with the measured costs: median
    over the runs of measured / simulated; met when within 15 % (issue 19, item 2). None
    without a simulated bubble."""
    ratios = [b / s for b, s in zip(bubbles, sims) if b is not None and s]
    if not ratios:
        return None
    value = median(ratios)
    return {"name": "1f1b bubble measured / simulated (measured costs)", "value": value,
            "target": "<= 1.15", "met": bool(0.85 <= value <= 1.15),
            "spread": [min(ratios, default=value), max(ratios, default=value)],
            "pairs": len(ratios), "noise": False, "ratios": ratios}


def explain(ratios: list[dict], samples: dict, bubble: dict, split: dict | None, m: int,
            pp: int) -> None:
    """Each comparison's measured reason (``why``, shown where it misses): what 1F1B waits
    for per step (``pp_idle_s`` of its runs), the bound that sets on beating Schedule1F1B,
    and what the split backward adds against the wait the zero-bubble schedules remove."""
    ours = samples["hpctrain 1f1b"]
    waits = [(o, i) for o, i in zip(ours, bubble["pp_idle_s"]) if i is not None]
    if not waits:
        return
    step, idle = median([o for o, _ in waits]), median([i for _, i in waits])
    mean_idle = median([i for i in bubble["idle_mean"] if i is not None])
    cores = os.cpu_count() or 1
    share = (f"; {pp} ranks share {cores} cores, so one rank's wait is partly another's "
             "compute" if pp > cores else "")
    for q in ratios:
        if q["name"].startswith("throughput hpctrain 1f1b"):
            q["why"] = bound_without(
                [o for o, _ in waits], samples["torch Schedule1F1B"], [i for _, i in waits], q,
                "hpctrain's busiest pp rank waits (bubble and transfers; against "
                "Schedule1F1B):") + share
        elif q["name"].startswith("step 1f1b / z") and split is not None:
            q["why"] = (f"the split backward costs {split['B+W']:.3g} backwards: "
                        f"{split['extra_s'] * m * 1e3:.0f} ms more compute per step and rank "
                        f"({m} microbatches), against {mean_idle * 1e3:.0f} ms a 1F1B rank "
                        "waits, which is all a zero-bubble schedule can remove" + share)
        elif q["name"].startswith("step spinning"):
            q["why"] = (f"the two ways of waiting differ only while a rank waits: "
                        f"{idle * 1e3:.0f} ms of a {step * 1e3:.0f} ms step on the busiest "
                        "rank" + share)
        elif q["name"].startswith("1f1b bubble"):
            meas = median([b for b in bubble["pp_bubble"] if b is not None])
            sim = median([b for b in bubble["pp_bubble_sim"] if b])
            q["why"] = (f"measured bubble {meas:.3f} of the step against the simulator's "
                        f"{sim:.3f} with the measured F/B costs: the rest is waiting on "
                        "transfers and on peers" + share)


def bench_config(size: str, pp: int, kind: str = "1f1b", *more: str):
    """pp=2: the size preset as it is; pp=4: 8 layers (two per rank for the V of zbv and
    dualpipev) and micro_batch_size halved (twice the microbatches, 8: zbv's steady state
    needs 2pp-1, dualpipev 2pp)."""
    extra = [] if pp == 2 else ["model.n_layers=8", "train.micro_batch_size=" + (
        "1" if size == "tiny" else "2")]
    return train_config(size, f"topology.pp={pp}", f'schedule.kind="{kind}"', *extra, *more)


def _ratios(samples: dict) -> list[dict]:
    ours, theirs = samples["hpctrain 1f1b"], samples["torch Schedule1F1B"]
    out = [paired("throughput hpctrain 1f1b / torch Schedule1F1B", theirs, ours, ">= 1.15"),
           paired("step spinning MPI_Wait / yielding wait",
                  samples["hpctrain 1f1b, spinning MPI_Wait"], ours, ">= 1.0")]
    for kind in ZERO_BUBBLE:
        if f"hpctrain {kind}" in samples:
            out.append(paired(f"step 1f1b / {kind}", ours, samples[f"hpctrain {kind}"],
                              ">= 1.0"))
    if "hpctrain dualpipev" in samples:
        out.append(paired("step zbv / dualpipev", samples["hpctrain zbv"],
                          samples["hpctrain dualpipev"], ">= 1.0"))
    return out


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world``; the sides run in turns (>= 5 rounds, order rotated), each
    sample the median steady step of one training run."""
    pp = world.size
    cfg = bench_config(size, pp)
    torch_dist(world)
    split = [f"{r.start}-{r.stop - 1}" for r in partition(cfg.model.n_layers, pp)]
    m = cfg.train.global_batch_size // cfg.train.micro_batch_size
    rounds = pairs_of(repeats, size)  # the tiny smoke test: as given
    out = result("pipeline", world, size, rounds,
                 f"pp={pp}, {cfg.model.n_layers} layers ({split} for 1F1B), {m} microbatches "
                 f"of {cfg.train.micro_batch_size}x{cfg.train.seq_len}; A/B interleaved, "
                 f"{rounds} rounds")
    losses: dict = {}
    # per 1f1b run, median of steps; pp_idle_s: each pp rank's wait, kept as the busiest
    # rank's (min) and the mean over ranks
    bubble: dict = {"pp_bubble": [], "pp_bubble_sim": [], "pp_idle_s": [], "idle_mean": []}

    def side(name, fn):
        def sample():
            times, loss = fn()
            losses.setdefault(name, loss)
            return median(steady(times))
        return sample

    spin = bench_config(size, pp, "1f1b", 'experimental.p2p_wait="spin"')
    sides = {"hpctrain 1f1b": side("hpctrain 1f1b", lambda: run_1f1b(cfg, world, bubble)),
             "torch Schedule1F1B": side("torch", lambda: torch_pipeline(cfg, world)),
             "hpctrain 1f1b, spinning MPI_Wait": side("spin", lambda: hpctrain_run(spin, world))}
    if pp >= 4:  # the zero-bubble schedules against hpctrain's own 1F1B, same run
        for kind in ZERO_BUBBLE:
            c = bench_config(size, pp, kind)
            sides[f"hpctrain {kind}"] = side(kind, lambda c=c: hpctrain_run(c, world))
    load0 = loadavg()
    samples = interleave(sides, rounds)
    load1 = loadavg()
    out["rows"] = [row(n, v, "s/step") for n, v in samples.items()]
    out["ratios"] = _ratios(samples)
    measured = bubble_ratio(bubble["pp_bubble"], bubble["pp_bubble_sim"])
    if measured is not None:
        out["ratios"].append(measured)
        out["notes"].append("1f1b bubble per run, measured / simulated: " + ", ".join(
            f"{b:.3f}/{s:.3f}" for b, s in zip(bubble["pp_bubble"], bubble["pp_bubble_sim"])
            if b is not None and s))
    split = split_measured(world, cfg, rounds, out["notes"]) if pp >= 4 else None
    load1 = loadavg() if split else load1
    explain(out["ratios"], samples, bubble, split, m, pp)
    out["load"] = {"before": load0, "after": load1}
    out["notes"].append(f"load average before {load0}, after {load1}")
    out["check"] = same_losses(losses)
    return out
