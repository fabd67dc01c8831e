"""The model in plain PyTorch: no MPI here (see docs/design.md). Imports only ``config``.

- ``gpt.py``: :class:`GPTStage` (a contiguous run of blocks, plus the embedding on the
  first stage and the head and loss on the last), parameters with their global shapes
  (:class:`ParamMeta`), layout-independent initialisation.
- ``moe.py``: the mixture-of-experts feed-forward; the token exchange is injected.
- ``steps.py``: the forward as a generator that pauses at the expert all-to-alls, and
  :func:`drive`, which runs it with blocking exchanges (the plain forward).
"""

from .gpt import DTYPES, GPTStage, LocalOps, ParamMeta, init_parameters, shard_range
from .steps import Exchange, RunBlock, RunExperts, drive

__all__ = ["DTYPES", "Exchange", "GPTStage", "LocalOps", "ParamMeta", "RunBlock", "RunExperts",
           "drive", "init_parameters", "shard_range"]
