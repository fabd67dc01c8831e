"""Multi-token prediction (DeepSeek-V3 §2.2, ``model.mtp_depth = D``) in plain PyTorch. No MPI.

Module ``k`` (1..D) predicts the token ``k + 1`` after each position: from the previous depth's
hidden state ``h`` (depth 0: the last block's output, before the final norm) and the embedding
of the token ``k`` after (the main model's embedding), ``h' = eh_proj [enorm(emb); hnorm(h)]``
goes through one more block of the family (global block index ``n_layers + k - 1``, an MoE
block where ``ModelConfig.moe_layer`` says so), then its own norm and the main model's head.
Positions whose target lies past the window (the last ``k``) do not count. The objective
adds ``mtp_loss_weight / D`` times the modules' summed token cross-entropies to the main loss
(both scaled by the step's ``1 / global tokens``); the reported loss stays the main one.
Names and the layout of DeepSeek's checkpoints (layer ``n_layers + k - 1``: ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``): ``families/deepseek.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import NORMS, ParamMeta, _param
from .weight_grad import linear


class MTPModule(nn.Module):
    """The parts of one depth besides its block: the two input norms, the projection of
    their concatenation (C, 2C: embedding first, as DeepSeek's checkpoints and Megatron-Core
    order it) and the output norm. Replicated over tp; with sequence parallelism each rank
    sees part of the sequence, so their gradients are summed over tp."""

    def __init__(self, cfg: ModelConfig, norm: str, dtype, sp: bool):
        super().__init__()
        C, layer = cfg.d_model, NORMS[norm]
        self.enorm = layer(C, cfg.norm_eps, dtype, sp)
        self.hnorm = layer(C, cfg.norm_eps, dtype, sp)
        self.eh_proj = _param((C, 2 * C), ParamMeta((C, 2 * C), sp_partial=sp,
                                                    std=cfg.init_std), dtype)
        self.norm = layer(C, cfg.norm_eps, dtype, sp)

    def project(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input from the next tokens' embeddings and the previous hidden."""
        return linear(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1),
                      self.eh_proj)


class _AddObjective(torch.autograd.Function):
    """Identity on the main loss; backward also gives ``extra`` the main loss's gradient
    times ``weight``: ``extra`` joins the objective without changing the reported loss."""

    @staticmethod
    def forward(ctx, main, extra, weight):
        ctx.weight = weight
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad * ctx.weight, None


def with_objective(main: torch.Tensor, extra: torch.Tensor, weight: float) -> torch.Tensor:
    """``main`` (the value reported) whose backward is that of ``main + weight * extra``."""
    return _AddObjective.apply(main, extra, weight)


def valid_rows(targets: torch.Tensor) -> torch.Tensor:
    """Flat indices of the positions whose target exists (not -1)."""
    return (targets.reshape(-1) >= 0).nonzero().squeeze(1)
