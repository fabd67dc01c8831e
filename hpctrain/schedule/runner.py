"""Execute one rank's schedule for one optimizer step.

With one pipeline stage the schedule is forward then backward of each microbatch in turn.
"""

from __future__ import annotations


def run_step(chunks, microbatches, topo, cfg, loss_scale: float, timers=None) -> float:
    """Forward and backward of every microbatch on this rank; gradients accumulate in the
    parameters' ``.grad``. Returns the sum of token losses this rank computed (non-zero only
    on the last stage). ``loss_scale`` = 1 / tokens in the global batch."""
    if topo.pp_size != 1 or len(chunks) != 1:
        raise NotImplementedError("pipeline parallelism is not available in this build")
    (stage,) = chunks
    total = 0.0
    for x, y in microbatches:
        loss = stage(x, y)
        (loss * loss_scale).backward()
        total += float(loss.detach())
    return total
