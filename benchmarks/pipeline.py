"""Pipeline training throughput on 2 ranks: ``hpctrain train`` with ``schedule.kind=1f1b``,
pp=2, against ``torch.distributed.pipelining.Schedule1F1B`` (gloo), same split of layers
(``parallel.pipeline.partition``), init, data and microbatches; same losses required."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hpctrain.data import Sampler, load_tokens
from hpctrain.model import GPTStage, init_parameters
from hpctrain.optim import lr_at
from hpctrain.parallel.pipeline import partition

from .common import (
    hpctrain_run,
    median,
    ratio,
    result,
    row,
    same_losses,
    steady,
    torch_dist,
    torch_optimizer,
    train_config,
)

RANKS = (2,)


class _Logits(torch.nn.Module):
    """The last stage for torch pipelining: blocks, final norm and head -> logits
    (B, T, V); the loss is the schedule's ``loss_fn`` (torch keeps them apart)."""

    def __init__(self, stage: GPTStage):
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
    stage = GPTStage(cfg.model, ranges[rank], first=rank == 0, last=rank == pp - 1)
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


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world``; alternates the two sides ``repeats`` times."""
    cfg = train_config(size, f"topology.pp={world.size}", 'schedule.kind="1f1b"')
    torch_dist(world)
    split = [f"{r.start}-{r.stop - 1}" for r in partition(cfg.model.n_layers, world.size)]
    out = result("pipeline", world, size, repeats,
                 f"1F1B, pp={world.size}, layers {split}, "
                 f"{cfg.train.global_batch_size // cfg.train.micro_batch_size} microbatches")
    ours, theirs, losses = [], [], {}
    for r in range(repeats):
        sides = [("hpctrain", lambda: hpctrain_run(cfg, world)),
                 ("torch Schedule1F1B", lambda: torch_pipeline(cfg, world))]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            times, loss = fn()
            (ours if name == "hpctrain" else theirs).append(median(steady(times)))
            losses.setdefault(name, loss)
    out["rows"] = [row("hpctrain 1f1b (MPI isend/irecv)", ours, "s/step"),
                   row("torch Schedule1F1B (gloo)", theirs, "s/step")]
    out["ratios"] = [ratio("throughput hpctrain / torch", median(theirs) / median(ours),
                           ">= 1.1")]
    out["check"] = same_losses(losses)
    return out
