"""Held-out evaluation under any layout.

Evaluation is forward-only on the validation split: every layout evaluates the same global
batches (a fixed stream, seeded apart from training) with the same microbatch split, each dp
rank its slice; pipeline stages pass activations forward with ``isend``/``irecv`` on
``topo.pp_comm`` (a forward-only schedule: microbatch by microbatch, chunk by chunk, which
cannot deadlock); the loss sums are reduced over the world once. The result equals the
one-rank value (invariant 1).
"""

from __future__ import annotations

import torch

from .data.dataset import Sampler, load_tokens
from .parallel.pipeline import chunks_of_rank, rank_of_stage, style_of

EVAL_SEED_OFFSET = 7919  # the validation stream is independent of the training stream


class Evaluator:
    """Validation loss of this rank's model pieces; ``run()`` is collective over the world."""

    def __init__(self, cfg, topo, chunks, device, info=None):
        t = cfg.train
        d = cfg.data
        val = load_tokens(d.path, "val", d.corpus_mb, d.val_fraction, d.tokenizer)
        if len(val.tokens) < t.seq_len + 2:
            raise ValueError(f"the validation split has {len(val.tokens)} tokens, fewer than "
                             f"seq_len+2 = {t.seq_len + 2}: raise data.val_fraction or "
                             "data.corpus_mb, or set train.eval_every = 0")
        self.cfg, self.topo, self.chunks = cfg, topo, chunks
        self.sampler = Sampler(val.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                               topo.dp_size, topo.dp_rank, t.seed + EVAL_SEED_OFFSET,
                               device=device, cp_size=topo.cp_size, cp_rank=topo.cp_rank)
        self.tokens = t.eval_batches * t.global_batch_size * t.seq_len
        self.info = info or (lambda msg: None)

    @torch.no_grad()
    def run(self) -> float:
        topo = self.topo
        total = 0.0
        for b in range(self.cfg.train.eval_batches):
            total += forward_only(self.chunks, self.sampler.local(b), topo, self.cfg)
        owner = any(c.last for c in self.chunks) and topo.tp_rank == 0  # zbv: pp rank 0
        loss = topo.world.allreduce(total if owner else 0.0) / self.tokens
        self.info(f"validation loss {loss:.4f} ({self.tokens:,} held-out tokens)")
        return loss


def activation_shape(cfg, topo) -> tuple[int, int, int]:
    """(mbs, T/cp, or T/(cp*tp) under sequence parallelism, C): what crosses a stage
    boundary."""
    t = cfg.train
    T = t.seq_len // topo.cp_size
    T = T // topo.tp_size if cfg.topology.sequence_parallel else T
    return (t.micro_batch_size, T, cfg.model.d_model)


def forward_only(chunks, microbatches, topo, cfg) -> float:
    """Sum of token losses of ``microbatches`` (non-zero on the last stage only). Chunk k of
    this rank is virtual stage ``stages[k]`` (``parallel.pipeline.chunks_of_rank``: ``pp_rank
    + k*pp``, or the V of zbv); its input comes from the rank holding the stage before and
    its output goes to the rank holding the stage after (the rank itself between the two
    middle stages of the V). Tags: see :func:`eval_tag`."""
    pp, r = topo.pp_size, topo.pp_rank
    style = style_of(cfg.schedule.kind)
    stages = chunks_of_rank(r, pp, len(chunks), style)
    shape = activation_shape(cfg, topo)
    tag_ub = topo.pp_comm.tag_ub
    sends, total = [], 0.0
    for x, y in microbatches:
        for stage, chunk in zip(stages, chunks):
            if chunk.first:
                h = x
            else:
                h = torch.empty(shape, dtype=next(chunk.parameters()).dtype, device=x.device)
                prev = rank_of_stage(stage - 1, pp, style)
                topo.pp_comm.irecv(h, prev, tag=eval_tag(stage, tag_ub)).wait()
            out = chunk(h, y if chunk.last else None)
            if chunk.last:
                total += float(out)
            else:
                out = out.contiguous()
                nxt = rank_of_stage(stage + 1, pp, style)
                sends.append(topo.pp_comm.isend(out, nxt, tag=eval_tag(stage + 1, tag_ub)))
    for s in sends:
        s.wait()
    return total


def eval_tag(stage: int, tag_ub: int) -> int:
    """MPI tag of the activation that virtual stage ``stage`` receives: ``stage`` modulo
    ``tag_ub + 1`` (``Group.tag_ub``, at least 32767), whatever the number of microbatches.

    Why a tag per stage (not per microbatch) is enough, and even a wrapped one: every rank
    posts its sends and its receives in the same global order, microbatch by microbatch,
    then by stage, and waits for each receive before it goes on. On one link (source, dest,
    tag) the two sides therefore post the same (microbatch, stage) sequence, and MPI's
    non-overtaking rule matches the i-th send with the i-th receive. Evaluation never meets
    the pipeline runner's messages (tags ``pipeline.actions.link``) on ``pp_comm``: it runs
    between steps, after ``run_step`` has waited for all its sends and consumed every receive
    (it checks), and it waits for all its own sends before returning."""
    return stage % (tag_ub + 1)
