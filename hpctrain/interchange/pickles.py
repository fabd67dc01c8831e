"""Foreign checkpoints are data, never code. Three files of the formats hpctrain reads are
pickles: torch DCP's ``.metadata`` (a plain pickle, which torch's own reader opens with
``pickle.load``), Megatron-Core's ``common.pt`` and DCP's bytes entries (``torch.save``
files). Unpickling runs whatever callables a pickle names and lets it set attributes on
whatever it reaches, so all three are read by one strict interpreter, :class:`DataUnpickler`
(torch's own loader still reads a ``torch.save`` file's zip archive and tensor storages and
hands the pickle inside to it):

- A global is looked up in :data:`ADMITTED` (the data classes of the formats, dtypes,
  containers), never imported by name; Python 3.13's ``pathlib._local`` names are read as
  the pure paths they stand for, and no path class that touches the filesystem is made.
- Classes of other programs that a checkpoint describes but hpctrain need not run (Megatron's
  ``args`` namespace and enums, numpy scalars in it) become :class:`Record`\\ s: the class's
  name, the arguments and the attributes, as plain data; nothing of theirs is imported.
- Anything else (``os.system``, ``builtins.eval``, a class of an unknown module) is refused
  with :class:`UnsafePickle` naming the file and the global, before it is called.
- Only admitted callables are called (``REDUCE``, ``NEWOBJ``), with a tuple of arguments.
- ``BUILD`` (setting state) acts only on an instance this unpickler itself made, never on a
  class or on anything a global named, so no process-wide attribute can be changed;
  ``SETITEM``/``APPEND``/``ADDITEMS`` act only on real dicts, lists and sets; extension codes,
  ``INST``/``OBJ`` (protocol 0-1 instances) and persistent ids outside ``torch.save``'s
  storages are refused, naming the opcode.

Why not torch's own weights-only unpickler: it has no way to read a class it does not admit
as data (Megatron's enums), and a ``.metadata`` is not a ``torch.save`` file; see
docs/decisions.md ("Foreign pickles: one strict interpreter").
"""

from __future__ import annotations

import _compat_pickle
import collections
import encodings.raw_unicode_escape  # noqa: F401  (protocol 0's UNICODE opcode decodes with it)
import functools
import importlib
import io
import pickle
import types
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from . import InterchangeError

DCP_META = "torch.distributed.checkpoint.metadata"
_PURE = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath,
         "WindowsPath": PureWindowsPath, "PureWindowsPath": PureWindowsPath,
         "Path": PurePosixPath, "PurePath": PurePosixPath}
# module -> names a foreign pickle may name (torch 2.1 to today, and Megatron-Core's writer,
# which caches its save plans in the DCP metadata); pathlib names map to pure paths (_PURE)
ADMITTED = {
    DCP_META: {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
               "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
               "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType",
                                             "TensorWriteData", "BytesIOWriteData"},
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties",
                                                         "MEM_FORMAT_ENCODING"},
    "torch.distributed._shard.metadata": {"ShardMetadata"},
    "torch.serialization": {"_get_layout"},  # a layout by name: "torch.strided"
    "torch._utils": {"_rebuild_tensor_v2"},  # a tensor of a torch.save file (checked)
    "torch": {"Size"},  # and every dtype and layout (:func:`_torch_constant`)
    "pathlib": set(_PURE), "pathlib._local": set(_PURE),
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
    "_codecs": {"encode"},  # how protocol 2 pickles bytes
}
# the first torch whose archive and storage reading has no published bypass (docs/decisions.md)
SAFE_TORCH = (2, 10)
# values waiting on the stack (nesting): a DCP metadata of a million chunks waits on tens
DEEPEST = 100_000
# classes read as a Record (name, arguments, attributes), never imported
AS_RECORDS = ("argparse.Namespace", "types.SimpleNamespace", "megatron.",
              "transformer_engine.", "numpy.", "apex.")


class UnsafePickle(InterchangeError):
    """A pickle asks for something outside its format: refused, nothing called."""


class Record(types.SimpleNamespace):
    """An object of a class hpctrain reads but does not import (Megatron's ``args``
    namespace, an enum member such as ``AttnBackend(5)``): ``_class`` its class's
    ``module.name``, ``_args`` what it was made with, its pickled attributes as attributes."""

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if k not in ("_class", "_args")}
        return f"{vars(self).get('_class')}{vars(self).get('_args', ())!r}{fields or ''}"

    def __setstate__(self, state) -> None:
        """A pickled ``__dict__`` becomes attributes; any other state is kept as ``_state``."""
        if type(state) is dict and all(type(k) is str and not k.startswith("__") for k in state):
            vars(self).update(state)
        else:
            vars(self)["_state"] = state


class _RecordClass:
    """What a global outside :data:`ADMITTED` but inside :data:`AS_RECORDS` stands for:
    calling it, or ``NEWOBJ`` on it, makes a :class:`Record`."""

    def __init__(self, name: str):
        self.name = name

    def make(self, args: tuple) -> Record:
        return Record(_class=self.name, _args=args)


def _torch_constant(module: str, name: str):
    """``torch.<dtype>`` or ``torch.<layout>`` (data, not callables), else None."""
    if module != "torch":
        return None
    import torch

    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout)) else None


def _codecs_encode(text, encoding="latin1"):
    """``_codecs.encode`` as protocol 2 uses it for bytes: str in, bytes out, nothing else."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode with other than (str, 'latin1')")
    return text.encode("latin1")


def _tensor(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    """``torch._utils._rebuild_tensor_v2`` of a storage torch's loader read from the
    archive, without backward hooks (torch checks the view against the storage's size)."""
    import torch

    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)) or \
            type(hooks) not in (dict, collections.OrderedDict) or hooks:
        raise pickle.UnpicklingError("a tensor that is not storage, offset, size and stride")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
                                           hooks, metadata)


_STAND_INS = {("_codecs", "encode"): _codecs_encode,
              ("torch._utils", "_rebuild_tensor_v2"): _tensor}


@functools.cache
def _callables() -> dict[int, object]:
    """id -> object of everything :data:`ADMITTED` lets a pickle call: the formats' classes
    (from torch's own modules, loaded once here), the stand-ins and the pure paths."""
    out = {id(f): f for f in (*_STAND_INS.values(), *_PURE.values())}
    for module, names in ADMITTED.items():
        if module.startswith("pathlib") or module == "_codecs":
            continue
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name, None)
            if callable(obj) and (module, name) not in _STAND_INS:
                out[id(obj)] = obj
    return out


def _describe(obj) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, _RecordClass):
        return obj.name
    return f"a {type(obj).__name__}"


class DataUnpickler(pickle._Unpickler):
    """A pickle read as data (the module docstring's rules); ``origin`` names the file in
    every refusal. ``storages``: a ``torch.save`` archive is being read, whose persistent
    ids torch's loader resolves (it sets ``persistent_load``)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, stream, origin: str = "a pickle", storages: bool = False, **kwargs):
        super().__init__(stream, **kwargs)
        self.origin = origin
        self._made: dict[int, object] = {}  # id -> object: the instances this unpickler made
        if not storages:
            self.persistent_load = self._no_persistent

    def _refuse(self, what: str):
        raise UnsafePickle(
            f"{self.origin} {what}, which is not part of a checkpoint format: refused without "
            f"running it (a checkpoint is data; this file would run code or change the "
            f"program when loaded). Get the checkpoint from its writer again, or convert it "
            f"where you trust it")

    def _no_persistent(self, pid):
        self._refuse(f"holds a persistent reference ({str(pid)[:80]!r})")

    def find_class(self, module: str, name: str):
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as protocol 2 writes them
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if name not in ADMITTED.get(module, ()):
            constant = _torch_constant(module, name)
            if constant is not None:
                return constant
            if f"{module}.{name}".startswith(AS_RECORDS):
                return _RecordClass(f"{module}.{name}")
            full = f"{module}.{name}"
            self._refuse(f"asks for {full if full.isprintable() else ascii(full)}")
        if module.startswith("pathlib"):
            return _PURE[name]
        return _STAND_INS.get((module, name)) or super().find_class(module, name)

    def _keep(self, obj):
        self._made[id(obj)] = obj
        return obj

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if type(args) is not tuple:
            self._refuse("calls something with arguments that are not a tuple")
        if isinstance(func, _RecordClass):
            self.stack[-1] = self._keep(func.make(args))
        elif id(func) in _callables() and _callables()[id(func)] is func:
            self.stack[-1] = self._keep(func(*args))
        else:
            self._refuse(f"calls {_describe(func)}")

    def load_newobj(self):
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def _new(self, cls, args, kwargs):
        if isinstance(cls, _RecordClass):
            return self._keep(cls.make(args))
        if not isinstance(cls, type) or _callables().get(id(cls)) is not cls or \
                type(args) is not tuple or type(kwargs) is not dict:
            self._refuse(f"makes a new {_describe(cls)}")
        return self._keep(cls.__new__(cls, *args, **kwargs))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._made.get(id(inst)) is not inst or isinstance(inst, type):
            self._refuse(f"sets the state of {_describe(inst)} (opcode BUILD), which it did "
                         f"not make")
        setstate = getattr(type(inst), "__setstate__", None)
        if setstate is not None:
            setstate(inst, state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is not None and (type(part) is not dict or any(
                    type(k) is not str or k.startswith("__") for k in part)):
                self._refuse(f"sets attributes of {_describe(inst)} that are not plain names")
        vars(inst).update(state or {})
        for key, value in (slots or {}).items():
            setattr(inst, key, value)

    def load_append(self):
        self._container(self.stack[-2], list, "APPEND")
        super().load_append()

    def load_appends(self):
        self._container(self.metastack[-1][-1], list, "APPENDS")
        super().load_appends()

    def load_setitem(self):
        self._container(self.stack[-3], dict, "SETITEM")
        super().load_setitem()

    def load_setitems(self):
        self._container(self.metastack[-1][-1], dict, "SETITEMS")
        super().load_setitems()

    def load_additems(self):
        self._container(self.metastack[-1][-1], set, "ADDITEMS")
        super().load_additems()

    def _container(self, obj, kind: type, opcode: str) -> None:
        if type(obj) is not kind and not (kind is dict and type(obj) is collections.OrderedDict):
            self._refuse(f"adds items to {_describe(obj)} (opcode {opcode})")

    @staticmethod
    def _nest(load):
        """``load`` (an opcode that opens a container or a mark), unless the values waiting on
        the stack are already :data:`DEEPEST`: a nesting no checkpoint writes, which would
        take the interpreter and everything that walks the result unbounded time."""
        def checked(self):
            if len(self.stack) + len(self.metastack) > DEEPEST:
                self._refuse(f"nests values over {DEEPEST:,} deep")
            load(self)
        return checked

    def _opcode(self):
        self._refuse("uses an opcode no checkpoint format writes (INST, OBJ or an extension "
                     "code)")


for _code in (pickle.MARK, pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.EMPTY_SET):
    DataUnpickler.dispatch[_code[0]] = DataUnpickler._nest(DataUnpickler.dispatch[_code[0]])
for _code in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
    DataUnpickler.dispatch[_code[0]] = DataUnpickler._opcode
for _code, _method in ((pickle.REDUCE, "load_reduce"), (pickle.NEWOBJ, "load_newobj"),
                       (pickle.NEWOBJ_EX, "load_newobj_ex"), (pickle.BUILD, "load_build"),
                       (pickle.APPEND, "load_append"), (pickle.APPENDS, "load_appends"),
                       (pickle.SETITEM, "load_setitem"), (pickle.SETITEMS, "load_setitems"),
                       (pickle.ADDITEMS, "load_additems")):
    DataUnpickler.dispatch[_code[0]] = getattr(DataUnpickler, _method)


def load_dcp_metadata(path: str | Path):
    """The ``Metadata`` of DCP file ``path`` (a ``.metadata``), read as data; a damaged file
    or any other object is an :class:`InterchangeError`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InterchangeError(f"cannot read {path}: {e.strerror}") from None
    meta = _read(lambda: DataUnpickler(io.BytesIO(data), str(path)).load(), path,
                 "a readable DCP metadata file")
    if not isinstance(meta, Metadata) or not all(
            hasattr(meta, a) for a in ("state_dict_metadata", "storage_data")):
        raise InterchangeError(f"{path} holds {_describe(meta)} without DCP Metadata's "
                               f"entries and storage records: damaged; copy it again")
    return meta


def _read(load, origin, what: str):
    """``load()``; whatever goes wrong (but a refusal) is one :class:`InterchangeError`."""
    try:
        return load()
    except UnsafePickle:
        raise
    except Exception as e:  # truncated, not a pickle, wrong types: say so, never a traceback
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise InterchangeError(f"{origin} is not {what} ({detail})") from None


def _torch_pickle_module(origin: str):
    """A ``pickle_module`` for ``torch.load``: its Unpickler is :class:`DataUnpickler`."""

    class Unpickler(DataUnpickler):
        def __init__(self, stream, **kwargs):
            super().__init__(stream, origin=origin, storages=True, **kwargs)

    return types.SimpleNamespace(__name__=__name__, Unpickler=Unpickler,
                                 load=lambda f, **kw: Unpickler(f, **kw).load())


def load_torch_data(path: str | Path | io.BytesIO, origin: str):
    """A ``torch.save`` file (Megatron's ``common.pt``, a DCP bytes entry) read as data:
    torch's loader reads the zip archive and the tensor storages, :class:`DataUnpickler` the
    pickle. Only the zip format (torch >= 1.6, what every supported writer makes) is read."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < SAFE_TORCH:
        raise InterchangeError(
            f"{origin}: torch {torch.__version__} reads the tensors of a torch.save file "
            f"without checking their sizes against the archive (GHSA-63cw-57p8-fm3p): "
            f"install torch >= {'.'.join(map(str, SAFE_TORCH))} to read foreign checkpoints")
    if not zipfile.is_zipfile(path):
        raise InterchangeError(f"{origin} is not a torch.save archive (a zip file)")
    if hasattr(path, "seek"):
        path.seek(0)
    return _read(lambda: torch.load(path, map_location="cpu", weights_only=False,
                                    pickle_module=_torch_pickle_module(origin)),
                 origin, "a readable torch.save file")
