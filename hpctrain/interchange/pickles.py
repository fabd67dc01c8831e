"""Foreign checkpoints are data, never code. Two files of the distributed-checkpoint formats
are pickles: torch DCP's ``.metadata`` (which torch's own reader opens with a plain
``pickle.load``) and Megatron-Core's ``common.pt`` (a ``torch.save``). Unpickling either runs
whatever callables it names, so hpctrain reads them with an unpickler that admits only the
classes those formats define (:data:`DCP_CLASSES`: DCP's metadata dataclasses, sizes,
dtypes, paths) and refuses anything else with :class:`UnsafePickle`, naming the file and the
class, before calling it. Tensors inside the ``.distcp`` files, and ``common.pt``, go through
``torch.load(weights_only=True)``, torch's own restricted unpickler.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from .hf_map import InterchangeError

DCP_META = "torch.distributed.checkpoint.metadata"
# module -> names: what a DCP .metadata pickle may construct (torch 2.1 to today)
DCP_CLASSES = {
    DCP_META: {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
               "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
               "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core's writer caches its save plans in the metadata
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType",
                                             "TensorWriteData", "BytesIOWriteData"},
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties",
                                                         "MEM_FORMAT_ENCODING"},
    "torch.distributed._shard.metadata": {"ShardMetadata"},
    "torch.serialization": {"_get_layout"},  # layout by name: "torch.strided"
    "torch": {"Size"},  # and every dtype (:func:`_is_dtype`)
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class UnsafePickle(InterchangeError):
    """A pickle names something outside its format's classes: refused, nothing called."""


def _is_dtype(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _Restricted(pickle.Unpickler):
    def __init__(self, stream, origin: Path):
        super().__init__(stream)
        self.origin = origin

    def find_class(self, module: str, name: str):
        if name in DCP_CLASSES.get(module, ()) or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafePickle(
            f"{self.origin} asks to construct {module}.{name}, which is not part of the "
            f"torch distributed-checkpoint format: refused without running it (a checkpoint "
            f"is data; this file would run code when loaded). Get the checkpoint from its "
            f"writer again, or convert it where you trust it")

    def persistent_load(self, pid):
        raise UnsafePickle(f"{self.origin} holds a persistent reference ({pid!r}): not a "
                           f"DCP metadata file")


def load_dcp_metadata(path: str | Path):
    """The ``Metadata`` of DCP file ``path`` (a ``.metadata``), read with the restricted
    unpickler; a damaged file or any other object is an :class:`InterchangeError`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InterchangeError(f"cannot read {path}: {e.strerror}") from None
    try:
        meta = _Restricted(io.BytesIO(data), path).load()
    except UnsafePickle:
        raise
    except Exception as e:  # truncated or not a pickle: say so, never a traceback
        raise InterchangeError(f"{path} is not a readable DCP metadata file ({e})") from None
    if not isinstance(meta, Metadata):
        raise InterchangeError(f"{path} holds a {type(meta).__name__}, not DCP Metadata")
    return meta


def load_torch_data(path: str | Path | io.BytesIO, origin: str, allowed: tuple = ()):
    """A ``torch.save`` file (Megatron's ``common.pt``, a DCP bytes entry) read with
    ``torch.load(weights_only=True)`` plus the classes in ``allowed``; anything else is
    refused as :class:`UnsafePickle` naming ``origin``."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafePickle(f"{origin}: refused to unpickle it ({str(e).splitlines()[0]}); "
                           f"only tensors and plain data are read from foreign "
                           f"checkpoints") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise InterchangeError(f"{origin} cannot be read: {e}") from None
