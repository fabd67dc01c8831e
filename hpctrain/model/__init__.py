"""The model in plain PyTorch: no MPI here (see docs/design.md). Imports only ``config``.

- ``layers.py``: the layers of a block for ``model.arch`` gpt and llama (RMSNorm, rotary
  embeddings, grouped-query attention, GELU or SwiGLU MLP), parameters with their global
  shapes (:class:`ParamMeta`), the :class:`KVCache` of incremental decoding.
- ``stage.py``: :class:`Block` and :class:`DecoderStage` (a contiguous run of blocks, plus the
  embedding on the first stage and the head and loss on the last), layout-independent
  initialisation.
- ``moe.py``: the mixture-of-experts feed-forward; the token exchange is injected.
- ``steps.py``: the forward as a generator that pauses at the expert all-to-alls, and
  :func:`drive`, which runs it with blocking exchanges (the plain forward).
- ``weight_grad.py``: :func:`linear`, every weight matmul; armed for a zero-bubble step, its
  weight gradients wait in a :class:`Pending` store for ``W``.
"""

from .layers import ARCHS, KVCache, ParamMeta, shard_range
from .stage import DTYPES, DecoderStage, LocalOps, init_parameters
from .steps import Exchange, RunBlock, RunExperts, drive

__all__ = ["ARCHS", "DTYPES", "Exchange", "DecoderStage", "KVCache", "LocalOps", "ParamMeta",
           "RunBlock", "RunExperts", "drive", "init_parameters", "shard_range"]
