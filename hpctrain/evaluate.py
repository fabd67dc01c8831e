"""Held-out evaluation under any layout.

Evaluation is forward-only on the validation split: every layout evaluates the same global
batches (a fixed stream, seeded apart from training) with the same microbatch split, each dp
rank its slice. Each batch goes through the pipeline runner's forward-only schedule
(``pipeline.runner.run_forward``: the schedule kind's forwards without backward, over the
training links and tags, under ``torch.no_grad()``); the loss sums are reduced over the world
once. The result equals the one-rank value (invariant 1).
"""

from __future__ import annotations

from .data.blend import open_stream
from .data.sampler import Sampler
from .pipeline.runner import run_forward

EVAL_SEED_OFFSET = 7919  # the validation stream is independent of the training stream


class Evaluator:
    """Validation loss of this rank's model pieces; ``run()`` is collective over the world.
    With a blend (``data.sources``) the blended validation stream gives ``val_loss`` and each
    source's validation split alone (its own order) ``val_loss/NAME``."""

    def __init__(self, cfg, topo, chunks, device, info=None):
        t = cfg.train
        self.cfg, self.topo, self.chunks = cfg, topo, chunks
        self.sampler, _ = open_stream(cfg.data, "val", t.seq_len, t.global_batch_size,
                                      t.micro_batch_size, topo.dp_size, topo.dp_rank,
                                      t.seed + EVAL_SEED_OFFSET, device, topo.cp_size,
                                      topo.cp_rank)
        self.each: dict[str, Sampler] = dict(zip(self.sampler.names, self.sampler.parts)) \
            if cfg.data.sources else {}
        self.tokens = t.eval_batches * t.global_batch_size * t.seq_len
        self.info = info or (lambda msg: None)

    def loss(self, sampler: Sampler) -> float:
        """The mean token loss of ``train.eval_batches`` batches of ``sampler``. Collective."""
        topo = self.topo
        total = 0.0
        for b in range(self.cfg.train.eval_batches):
            total += run_forward(self.chunks, sampler.local(b), topo, self.cfg)
        owner = any(c.last for c in self.chunks) and topo.tp_rank == 0  # zbv: pp rank 0
        return topo.world.allreduce(total if owner else 0.0) / self.tokens

    def run(self) -> dict[str, float]:
        """``{"val_loss": ...}``, and ``"val_loss/NAME"`` per source of a blend."""
        out = {"val_loss": self.loss(self.sampler)}
        out.update({f"val_loss/{name}": self.loss(s) for name, s in self.each.items()})
        each = "".join(f", {k[9:]} {v:.4f}" for k, v in out.items() if k != "val_loss")
        self.info(f"validation loss {out['val_loss']:.4f}{each} ({self.tokens:,} held-out "
                  "tokens)")
        return out
