"""The model in plain PyTorch: no MPI here (see docs/design.md). Imports only ``config``.

- ``families/``: one module per model family (``gpt.py``, ``llama.py``, ``mixtral.py``) and
  the registry (:func:`family_of`) that maps a config to its family; a family owns its layer
  choices, FLOP and memory terms, Hugging Face form and config checks. Everything else asks
  the registry instead of reading ``model.arch``.
- ``layers.py``: the layers a family chooses from (RMSNorm, rotary embeddings, grouped-query
  or multi-head attention, gated or plain MLP), parameters with their global shapes
  (:class:`ParamMeta`), the :class:`KVCache` of incremental decoding.
- ``stage.py``: :class:`Block` and :class:`DecoderStage` (a contiguous run of blocks, plus the
  embedding on the first stage and the head and loss on the last), layout-independent
  initialisation.
- ``moe.py``: the mixture-of-experts feed-forward; the token exchange is injected.
- ``steps.py``: the forward as a generator that pauses at the expert all-to-alls, and
  :func:`drive`, which runs it with blocking exchanges (the plain forward).
- ``weight_grad.py``: :func:`linear`, every weight matmul; armed for a zero-bubble step, its
  weight gradients wait in a :class:`Pending` store for ``W``.
"""

from importlib import import_module

# Each name and the module that holds it, imported when first asked for: the config checks
# reach ``model.families`` without importing torch (the layers and the stage need it).
_HOMES = {"Family": "families", "family_of": "families", "ARCHS": "layers",
          "KVCache": "layers", "ParamMeta": "layers", "shard_range": "layers",
          "DTYPES": "stage", "DecoderStage": "stage", "LocalOps": "stage",
          "init_parameters": "stage", "Exchange": "steps", "RunBlock": "steps",
          "RunExperts": "steps", "drive": "steps"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_HOMES[name]}", __name__), name)
