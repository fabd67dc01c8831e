"""Stage 4: the update. AdamW and its learning-rate schedule, the global gradient norm
(each parameter counted once), loss scaling, ZeRO-1/2, and the numeric guard.

- ``adamw.py``: :class:`AdamW`, :func:`lr_at` (warmup + cosine), :func:`global_grad_norm`,
  :class:`LossScaler`.
- ``zero.py``: :class:`ZeroAdamW` (optimizer state and, with ZeRO-2, gradients sharded over
  dp) and :func:`build_optimizer`.
- ``numeric_guard.py``: :class:`NumericGuard`: a non-finite or spiking step is skipped, then
  rolled back or stopped.
"""

from .adamw import AdamW, lr_at
from .numeric_guard import NumericError, NumericGuard
from .zero import ZeroAdamW, build_optimizer

__all__ = ["AdamW", "NumericError", "NumericGuard", "ZeroAdamW", "build_optimizer", "lr_at"]
