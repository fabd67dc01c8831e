"""Held-out evaluation under any layout.

Evaluation is forward-only on the validation split: every layout evaluates the same global
batches (a fixed stream, seeded apart from training) with the same microbatch split, each dp
rank its slice. Each batch goes through the pipeline runner's forward-only schedule
(``pipeline.runner.run_forward``: the schedule kind's forwards without backward, over the
training links and tags, under ``torch.no_grad()``); the loss sums are reduced over the world
once. The result equals the one-rank value (invariant 1).
"""

from __future__ import annotations

from .data import segments
from .data.dataset import load_tokens
from .data.sampler import Sampler
from .pipeline.runner import run_forward

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
                               device=device, cp_size=topo.cp_size, cp_rank=topo.cp_rank,
                               documents=segments.for_split(d, "val", t.seq_len))
        self.tokens = t.eval_batches * t.global_batch_size * t.seq_len
        self.info = info or (lambda msg: None)

    def run(self) -> float:
        topo = self.topo
        total = 0.0
        for b in range(self.cfg.train.eval_batches):
            total += run_forward(self.chunks, self.sampler.local(b), topo, self.cfg)
        owner = any(c.last for c in self.chunks) and topo.tp_rank == 0  # zbv: pp rank 0
        loss = topo.world.allreduce(total if owner else 0.0) / self.tokens
        self.info(f"validation loss {loss:.4f} ({self.tokens:,} held-out tokens)")
        return loss
