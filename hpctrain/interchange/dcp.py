"""torch Distributed Checkpoint (DCP) directories, read and written one tensor at a time in
one process, through torch's own reader and writer (``torch.distributed.checkpoint``,
``no_dist=True``: no process group). A DCP directory is ``.metadata`` (the global shape,
dtype and chunks of every entry, a pickle: read by :mod:`.pickles`' restricted unpickler)
and ``__R_N.distcp`` files (the chunks). :class:`Reader` loads one whole tensor, resharded
from however many chunks the writer's ranks left, into one buffer; :func:`save` writes a
checkpoint whose tensors are produced one by one when the writer asks for them. Neither holds
more than one tensor of the checkpoint at a time.

A checkpoint is data from elsewhere: before anything is read, :func:`check_metadata` checks
that every tensor's chunks cover it exactly once (:mod:`.chunks`), that every chunk has its
storage record, and that every record names a file inside the directory that is long enough
for the bytes recorded in it; a failure while reading (a file damaged inside) is one
:class:`InterchangeError` naming the entry and the files.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

from . import InterchangeError, chunks
from .pickles import load_dcp_metadata, load_torch_data

METADATA = ".metadata"
ONE_PROCESS = "torch.distributed is disabled"  # DCP's warning: no_dist=True is meant
LIMIT = 1 << 48  # above any tensor dimension, offset or file length a checkpoint records
DAMAGED = "copy the checkpoint again from its writer"


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


class _Destination:
    """The part of a destination tensor a stored chunk is copied into (what torch's reader
    asks ``resolve_tensor`` for): the copy is refused unless the chunk has the dtype the
    metadata states, since torch would convert it silently (a float32 chunk under float16
    metadata would import rounded)."""

    def __init__(self, target, fqn: str):
        self.target, self.fqn = target, fqn

    def detach(self):
        return self

    def size(self):
        return self.target.size()

    def copy_(self, chunk):
        if chunk.dtype != self.target.dtype:
            raise InterchangeError(
                f"{self.fqn} is stored as {chunk.dtype}, but the metadata states "
                f"{self.target.dtype}: the metadata does not describe its files; {DAMAGED}")
        self.target.copy_(chunk)


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

        def resolve_tensor(self, read_item):
            return _Destination(super().resolve_tensor(read_item), read_item.dest_index.fqn)

        def commit_tensor(self, read_item, tensor) -> None:
            pass  # the values are in the caller's tensor already

    class LazySavePlanner(DefaultSavePlanner):
        def __init__(self, produce: Callable):
            super().__init__(flatten_state_dict=False)
            self.produce, self.last = produce, None

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            # torch's writer holds the tensor of the file it closed until it has the next
            # one: free that tensor's memory (written already) before making the next
            if self.last is not None and self.last.untyped_storage().resizable():
                self.last.untyped_storage().resize_(0)
            self.last = self.produce(write_item.index.fqn)
            return self.last

    return SafeLoadPlanner, LazySavePlanner


class Reader:
    """The entries of DCP directory ``directory``: ``tensors`` {key: (shape, torch dtype)},
    ``objects`` (keys of pickled entries); :meth:`tensor` and :meth:`object` load one."""

    def __init__(self, directory: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = Path(directory)
        if not is_dcp_directory(self.dir):
            raise InterchangeError(f"{self.dir} has no {METADATA}: not a torch distributed "
                                   f"checkpoint (DCP) directory")
        self.meta = load_dcp_metadata(self.dir / METADATA)
        meta = self.meta
        self.tensors, self.objects = check_metadata(self.dir, meta)

        class SafeReader(FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                return meta

        self._fs = SafeReader(str(self.dir))

    def _load(self, state: dict, box=None) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        load_planner, _ = _planners()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ONE_PROCESS)
                dcp.load(state, storage_reader=self._fs, planner=load_planner(box),
                         no_dist=True)
        # torch's CheckpointException (a BaseException) wraps what failed while reading
        except (Exception, CheckpointException) as e:
            cause = _cause(e)
            if isinstance(cause, InterchangeError):
                raise cause from None
            files = sorted({str(self.dir / info.relative_path) for index, info
                            in self.meta.storage_data.items() if index.fqn in state})
            said = (str(cause).strip().splitlines() or [""])[0].split(". ")[0][:200]
            raise InterchangeError(
                f"reading {', '.join(state)} from {', '.join(files[:3])} failed "
                f"({type(cause).__name__}: {said}): the file is damaged; {DAMAGED}") from None
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


def _cause(e: BaseException) -> BaseException:
    """The exception a torch ``CheckpointException`` wraps (its first rank's), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def check_metadata(directory: Path, meta) -> tuple[dict, set]:
    """({key: (shape, torch dtype)} of the tensor entries, the keys of the pickled ones) of
    DCP metadata ``meta`` of ``directory``, once every entry is well formed, every tensor's
    chunks cover it exactly once, every chunk has a storage record and every record's bytes
    lie in a file inside the directory (:func:`check_storage`)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    where = directory / METADATA
    entries, stored = meta.state_dict_metadata, meta.storage_data
    if not isinstance(entries, dict) or not isinstance(stored, dict):
        raise InterchangeError(f"{where} lists no entries and storage records: not DCP "
                               f"metadata, or damaged; {DAMAGED}")
    tensors, objects = {}, set()
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise InterchangeError(f"{where} has an entry named {key!r}, not a string: "
                                   f"damaged; {DAMAGED}")
        if isinstance(entry, BytesStorageMetadata):
            objects.add(key)
            starts = [None]
        else:
            shape, dtype, starts = _tensor_entry(where, key, entry)
            tensors[key] = (shape, dtype)
        absent = next((o for o in starts if MetadataIndex(key, o) not in stored), False)
        if absent is not False:
            at = "" if absent is None else f" at offsets {tuple(absent)}"
            raise InterchangeError(f"{where}: {key}{at} has no storage record (no file holds "
                                   f"it): the metadata is incomplete; {DAMAGED}")
    check_storage(directory, stored)
    return tensors, objects


def _ints(values, what: str) -> tuple[int, ...]:
    out = tuple(values)
    if not all(type(v) is int and 0 <= v < LIMIT for v in out):
        raise ValueError(f"{what} {out!r}")
    return out


def _tensor_entry(where: Path, key: str, entry) -> tuple[tuple, object, list]:
    """(shape, dtype, offsets of its non-empty chunks) of tensor entry ``key``, refused
    unless its chunks cover it exactly once."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    try:
        if not isinstance(entry, TensorStorageMetadata):
            raise TypeError(f"a {type(entry).__name__}")
        shape, dtype = _ints(entry.size, "size"), entry.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype {dtype!r}")
        if not all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks):
            raise TypeError("chunks that are not DCP chunks")
        boxes = [(_ints(c.offsets, "offsets"), _ints(c.sizes, "sizes")) for c in entry.chunks]
    except (AttributeError, TypeError, ValueError) as e:
        raise InterchangeError(f"{where}: entry {key} is not a DCP tensor entry ({e}): "
                               f"damaged; {DAMAGED}") from None
    problem = chunks.cover_problem(shape, boxes)
    if problem:
        raise InterchangeError(f"{where}: tensor {key} {list(shape)}: {problem}; refused "
                               f"rather than filling it with whatever memory holds; {DAMAGED}")
    return shape, dtype, [o for o, s in boxes if all(s)]


def check_storage(directory: Path, stored: dict) -> None:
    """Every storage record (file, offset, length) names a file inside ``directory`` (not
    absolute, not through ``..`` or a symlink out of it) at least ``offset + length`` long."""
    where, root = directory / METADATA, directory.resolve()
    sizes: dict[str, int] = {}
    spans: dict[str, list] = {}
    for index, info in stored.items():
        name = getattr(index, "fqn", index)
        try:
            path, span = info.relative_path, _ints((info.offset, info.length), "bytes")
            if not isinstance(path, str):
                raise TypeError(path)
        except (AttributeError, TypeError, ValueError):
            raise InterchangeError(f"{where}: the storage record of {name} is not a file, "
                                   f"offset and length: damaged; {DAMAGED}") from None
        if path not in sizes:
            sizes[path] = _file_size(directory, root, path, name)
        if sum(span) > sizes[path]:
            raise InterchangeError(
                f"{directory / path} is {sizes[path]} bytes, but {name} is recorded at bytes "
                f"{span[0]} to {sum(span)}: the file is truncated; {DAMAGED}")
        spans.setdefault(path, []).append((*span, name))
    for path, parts in spans.items():
        _check_disjoint(directory / path, sorted(parts, key=lambda p: p[:2]))


def _check_disjoint(path: Path, parts: list) -> None:
    """The (offset, length, entry) records of one file, sorted, share no byte: two entries
    read from the same bytes would import one of them as the other."""
    for (a, n, first), (b, _, second) in zip(parts, parts[1:]):
        if b < a + n:
            raise InterchangeError(f"{path}: {second} is recorded at byte {b}, inside {first} "
                                   f"(bytes {a} to {a + n}): the metadata does not describe "
                                   f"its files; {DAMAGED}")


def _file_size(directory: Path, root: Path, path: str, name: str) -> int:
    """The length of ``directory / path``, refused outside ``root`` or missing."""
    target = directory / path
    try:
        inside = not Path(path).is_absolute() and target.resolve().is_relative_to(root)
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        inside = False
    if not inside:
        raise InterchangeError(
            f"{directory / METADATA}: {name} is stored at {path!r}, which leads outside "
            f"{directory}: refused (a checkpoint's files lie in its own directory)")
    if not target.is_file():
        raise InterchangeError(f"{target} is missing (the metadata stores {name} in it): "
                               f"copy the whole checkpoint directory")
    return target.stat().st_size


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
