"""torch Distributed Checkpoint (DCP) directories, read and written one tensor at a time in
one process, through torch's own reader and writer (``torch.distributed.checkpoint``,
``no_dist=True``: no process group). A DCP directory is ``.metadata`` (the global shape,
dtype and chunks of every entry, a pickle: read by :mod:`.pickles`' restricted unpickler)
and ``__R_N.distcp`` files (the chunks). :class:`Reader` loads one whole tensor, resharded
from however many chunks the writer's ranks left, into one buffer; :func:`save` writes a
checkpoint whose tensors are produced one by one when the writer asks for them. Neither holds
more than one tensor of the checkpoint at a time.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

from .hf_map import InterchangeError
from .pickles import load_dcp_metadata, load_torch_data

METADATA = ".metadata"
ONE_PROCESS = "torch.distributed is disabled"  # DCP's warning: no_dist=True is meant


def release_freed_memory() -> None:
    """Have glibc's malloc give tensors over 1 MiB their own mappings, returned on free. By
    default the threshold grows to the largest block freed, after which a stream of
    tensor-sized blocks fragments the heap: a conversion's peak then grows with the number
    of tensors (measured: +183 MiB over 288 MiB of tensors) instead of staying one tensor."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def is_dcp_directory(path: str | Path) -> bool:
    """A DCP directory, or a Megatron-LM save directory naming one."""
    from .megatron import LATEST

    return (Path(path) / METADATA).is_file() or (Path(path) / LATEST).is_file()


@functools.cache
def _planners():
    """(load planner, save planner) classes: DCP's defaults, except that a bytes entry is
    read as data (:func:`.pickles.load_torch_data`) and a tensor to save is produced when the
    writer asks for it."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class SafeLoadPlanner(DefaultLoadPlanner):
        def __init__(self, box=None):
            super().__init__(flatten_state_dict=False)
            self.box = box  # (offsets, sizes): read only this part of the one tensor

        def create_local_plan(self):
            if self.box is None:
                return super().create_local_plan()
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
            from torch.distributed.checkpoint.planner import LoadPlan
            from torch.distributed.checkpoint.planner_helpers import (
                create_read_items_for_chunk_list,
            )

            (fqn,) = self.state_dict
            chunk = ChunkStorageMetadata(torch.Size(self.box[0]), torch.Size(self.box[1]))
            return LoadPlan(create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], [chunk]))

        def lookup_tensor(self, index):
            if self.box is None:
                return super().lookup_tensor(index)
            return self.state_dict[index.fqn]  # the box's buffer: offsets are the box's

        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn  # into the caller's dict: self.state_dict is a copy
            self.original_state_dict[fqn] = load_torch_data(value, f"DCP entry {fqn}")

    class LazySavePlanner(DefaultSavePlanner):
        def __init__(self, produce: Callable):
            super().__init__(flatten_state_dict=False)
            self.produce = produce

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return self.produce(write_item.index.fqn)

    return SafeLoadPlanner, LazySavePlanner


class Reader:
    """The entries of DCP directory ``directory``: ``tensors`` {key: (shape, torch dtype)},
    ``objects`` (keys of pickled entries); :meth:`tensor` and :meth:`object` load one."""

    def __init__(self, directory: str | Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self.dir = Path(directory)
        if not is_dcp_directory(self.dir):
            raise InterchangeError(f"{self.dir} has no {METADATA}: not a torch distributed "
                                   f"checkpoint (DCP) directory")
        self.meta = load_dcp_metadata(self.dir / METADATA)
        meta = self.meta

        class SafeReader(FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                return meta

        self._fs = SafeReader(str(self.dir))
        entries = meta.state_dict_metadata.items()
        self.objects = {k for k, v in entries if isinstance(v, BytesStorageMetadata)}
        self.tensors = {k: (tuple(v.size), v.properties.dtype) for k, v in entries
                        if k not in self.objects}

    def _load(self, state: dict, box=None) -> dict:
        import torch.distributed.checkpoint as dcp

        load_planner, _ = _planners()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ONE_PROCESS)
                dcp.load(state, storage_reader=self._fs, planner=load_planner(box),
                         no_dist=True)
        except InterchangeError:
            raise
        except Exception as e:  # a missing or truncated .distcp file
            raise InterchangeError(f"{self.dir}: reading {', '.join(state)} failed: "
                                   f"{str(e).strip().splitlines()[-1][:300]}") from None
        return state

    def tensor(self, key: str, index: int | None = None, rows: int | None = None):
        """Entry ``key`` as one CPU tensor in its stored dtype: whole, or only ``[index]``
        of its first dimension (a layer of a stacked tensor), or only its first ``rows``
        rows (a padded vocabulary); only that part is read."""
        import torch

        shape, dtype = self.tensors[key]
        if index is None and rows is None:
            return self._load({key: torch.empty(shape, dtype=dtype)})[key]
        if index is not None:
            box = ((index,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
        else:
            box = ((0,) * len(shape), (rows, *shape[1:]))
        out = self._load({key: torch.empty(box[1], dtype=dtype)}, box)[key]
        return out[0] if index is not None else out

    def object(self, key: str):
        """A pickled entry (a step count, a learning rate), unpickled safely."""
        return self._load({key: None})[key]


def save(directory: str | Path, specs: dict, produce: Callable, values: dict | None = None
         ) -> None:
    """Write a DCP checkpoint to ``directory``: ``specs`` maps each tensor's key to its
    ``(shape, torch dtype)``, and ``produce(key)`` returns the tensor when the writer reaches
    it; ``values`` {key: plain value (a number, a tuple...)} are pickled by DCP."""
    import torch
    import torch.distributed.checkpoint as dcp

    _, save_planner = _planners()
    state = {k: torch.empty(v[0], dtype=v[1], device="meta") for k, v in specs.items()}
    state.update(values or {})
    Path(directory).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ONE_PROCESS)
        # one file per tensor: torch's writer keeps a file's tensors until it closes it
        writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=False,
                                      thread_count=1)
        dcp.save(state, storage_writer=writer, planner=save_planner(produce), no_dist=True)
