"""Expert selection of a mixture-of-experts router, as pure functions. Imports no MPI.

Per token, from its router scores ``s`` (n, E) (softmax or sigmoid of the logits):

* the **choice scores** are ``s + bias``: the per-expert bias of auxiliary-loss-free balancing
  (DeepSeek-V3 §2.1.2) steers which experts are picked, never how much they weigh;
* **group-limited routing**: the E experts form ``groups`` consecutive groups; a token scores
  each group by the sum of its two best choice scores there (one when a group holds one
  expert), keeps its ``top_groups`` best groups and picks its k experts among theirs;
* the **weights** of the k picked experts are their scores ``s`` (no bias), renormalised to
  sum 1 when asked, times the routed scaling factor.

The bias moves after each step by ``rate * sign(mean load - load)`` (:func:`bias_step`): an
overloaded expert's bias falls, an idle one's rises.
"""

from __future__ import annotations

import torch


def select(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None, groups: int = 1,
           top_groups: int = 0) -> torch.Tensor:
    """The k experts (n, k) of each token, best first, by ``scores + bias`` among the
    experts of its ``top_groups`` best groups (0 or ``groups``: all experts)."""
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if 0 < top_groups < groups:
        n, E = choice.shape
        per = choice.view(n, groups, E // groups)
        best = per.topk(min(2, E // groups), dim=-1).values.sum(-1)  # (n, groups)
        kept = best.topk(top_groups, dim=-1).indices
        mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
        mask = mask.unsqueeze(-1).expand(n, groups, E // groups).reshape(n, E)
        choice = choice.masked_fill(~mask, float("-inf"))
    return choice.topk(k, dim=-1).indices


def weights(scores: torch.Tensor, expert: torch.Tensor, renormalise: bool,
            scale: float = 1.0) -> torch.Tensor:
    """The combine weights (n, k) of the picked experts: their scores, renormalised to sum 1
    over the k when ``renormalise``, times ``scale``."""
    gate = scores.gather(1, expert)
    if renormalise:
        gate = gate / gate.sum(-1, keepdim=True)
    return gate * scale if scale != 1.0 else gate


def bias_step(bias: torch.Tensor, load, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean(load) - load)`` (``load``: assignments per expert)."""
    load = torch.as_tensor(load, dtype=torch.float64)
    step = torch.sign(load.mean() - load) * rate
    return bias + step.to(bias.device, bias.dtype)
