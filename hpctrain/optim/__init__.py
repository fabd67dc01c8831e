"""Stage 4: the update. AdamW and its learning-rate schedule, the global gradient norm
(each parameter counted once), loss scaling, ZeRO-1/2/3, and the numeric guard. The
optimizer reads gradients through the gradient sync's interface only
(``parallel.grad_sync.GradSync``: ``buckets``, ``segments``, ``zero_level``).

- ``adamw.py``: :class:`AdamW`, :func:`lr_at` (warmup + cosine), :func:`global_grad_norm`,
  :class:`LossScaler`.
- ``zero.py``: :class:`ZeroAdamW` (optimizer state sharded over dp; with ZeRO-2 the
  gradients too, with ZeRO-3 the parameters too) and :func:`build_optimizer`.
- ``numeric_guard.py``: :class:`NumericGuard`: a non-finite or spiking step is skipped, then
  rolled back or stopped.
"""

from .adamw import AdamW, lr_at
from .numeric_guard import NumericError, NumericGuard
from .zero import ZeroAdamW, build_optimizer

__all__ = ["AdamW", "NumericError", "NumericGuard", "ZeroAdamW", "build_optimizer", "lr_at"]
