"""Hand-written gadgets of the fuzz campaign that know a format: a DCP ``Metadata`` edited
as an object and pickled again (paths out of the directory, storage offsets and lengths
past the file, chunks with gaps and overlaps, dtypes and sizes that lie), Megatron's
``common.pt`` and its save directory's tracker, a safetensors header (lengths past the file,
offsets overlapping or out of range, dtypes and shapes that lie) and a Hugging Face index
whose ``weight_map`` points outside the directory. Each takes a ``random.Random`` and what
it edits, and returns ``(what it did, new bytes)`` (None: the file is removed).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import struct
import types
import warnings
import zipfile

import torch

from .fuzz_mutations import byte_mutation

DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.bool, torch.complex64)


# -- DCP .metadata as an object -------------------------------------------------------------
def _pick_tensor(rng, meta):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    keys = [k for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and len(v.size) >= 1]
    key = rng.choice(keys)
    return key, meta.state_dict_metadata[key]


def dcp_paths(rng, meta, paths: list[str]) -> str:
    """``relative_path`` of one storage entry (or all) set to another path."""
    path = rng.choice(paths)
    entries = list(meta.storage_data.values())
    chosen = entries if rng.random() < 0.3 else [rng.choice(entries)]
    for info in chosen:
        info.relative_path = path
    return f"relative_path of {len(chosen)} entr{'ies' if len(chosen) > 1 else 'y'} -> {path!r}"


def dcp_storage(rng, meta, paths=None) -> str:
    """A storage entry's offset or length moved past, before or inside the file."""
    index, info = rng.choice(list(meta.storage_data.items()))
    field = rng.choice(("offset", "length"))
    old = getattr(info, field)
    new = rng.choice((old + 1, old - 1, 0, -1, 1 << 40, old + 10_000_000, old // 2))
    setattr(info, field, new)
    return f"storage {index.fqn}: {field} {old} -> {new}"


def dcp_chunks(rng, meta, paths=None) -> str:
    """A tensor's chunks: one dropped (a gap), halved (a gap), doubled (an overlap), moved
    out of the tensor; or every tensor's chunks dropped."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    key, md = _pick_tensor(rng, meta)
    chunk, rows = md.chunks[0], md.size[0]
    kind = rng.choice(("drop", "halve", "overlap", "move", "drop all"))
    if kind == "drop":
        md.chunks = []
    elif kind == "halve":
        chunk.sizes = torch.Size([max(rows // 2, 1), *chunk.sizes[1:]])
    elif kind == "overlap":
        at = torch.Size([rows // 2, *([0] * (len(md.size) - 1))])
        md.chunks.append(ChunkStorageMetadata(at, torch.Size([rows - rows // 2,
                                                              *md.size[1:]])))
        first = next(v for k, v in meta.storage_data.items() if k.fqn == key)
        meta.storage_data[MetadataIndex(key, at, 1)] = copy.copy(first)
    elif kind == "move":
        chunk.offsets = torch.Size([rows // 2, *chunk.offsets[1:]])
    else:
        for md in meta.state_dict_metadata.values():
            if hasattr(md, "chunks"):
                md.chunks = []
        return "every tensor's chunks dropped"
    return f"chunks of {key} ({tuple(md.size)}): {kind}"


def dcp_lies(rng, meta, paths=None) -> str:
    """A tensor's dtype or size changed in the metadata (the stored bytes are not)."""
    key, md = _pick_tensor(rng, meta)
    if rng.random() < 0.5:
        dtype = rng.choice(DTYPES)
        md.properties.dtype = dtype
        return f"dtype of {key} -> {dtype}"
    size = tuple(md.size)
    new = rng.choice([(size[0] + 1, *size[1:]), (size[0] - 1, *size[1:]), size[::-1],
                      (size[0] * 2, *size[1:]), (), (1 << 40, *size[1:])])
    md.size = torch.Size(new)
    return f"size of {key} {size} -> {new}"


def dcp_entries(rng, meta, paths=None):
    """Entries removed or made bytes; or another object than Metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kind = rng.choice(("storage entry removed", "tensor as bytes", "no entries", "not Metadata"))
    if kind == "storage entry removed":
        del meta.storage_data[rng.choice(list(meta.storage_data))]
    elif kind == "tensor as bytes":
        meta.state_dict_metadata[_pick_tensor(rng, meta)[0]] = BytesStorageMetadata()
    elif kind == "no entries":
        meta.state_dict_metadata = {}
    else:
        return "a dict instead of Metadata", {"state_dict_metadata": {}, "storage_data": {}}
    return kind


DCP_EDITS = (dcp_paths, dcp_storage, dcp_chunks, dcp_lies, dcp_entries)


def dcp_object(rng, meta, paths: list[str]):
    """One of :data:`DCP_EDITS` on a copy of ``meta``, pickled as DCP pickles it."""
    meta = copy.deepcopy(meta)
    res = rng.choice(DCP_EDITS)(rng, meta, paths)
    what, obj = res if isinstance(res, tuple) else (res, meta)
    return f"Metadata: {what}", pickle.dumps(obj, protocol=pickle.DEFAULT_PROTOCOL)


# -- Megatron: common.pt and the tracker ----------------------------------------------------
class Payload:
    """Pickles as a call of ``func(*args)``."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def megatron_enum():
    """Megatron-Core's ``AttnBackend.auto`` (``--attention-backend``'s default) as its
    pickle names it, without importing Megatron: a stand-in module while pickling."""
    import enum

    module = types.ModuleType("megatron.core.transformer.enums")
    backend = enum.Enum("AttnBackend", [("flash", 1), ("fused", 2), ("unfused", 3),
                                        ("local", 4), ("auto", 5)])
    backend.__module__ = module.__name__
    module.AttnBackend = backend
    return module, backend.auto


def torch_saved(obj, enum_module=None) -> bytes:
    import sys

    buf = io.BytesIO()
    names = ["megatron", "megatron.core", "megatron.core.transformer", enum_module.__name__] \
        if enum_module else []
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = enum_module if n == names[-1] else types.ModuleType(n)
    try:
        torch.save(obj, buf)
    finally:
        for n, m in saved.items():
            sys.modules.pop(n) if m is None else sys.modules.__setitem__(n, m)
    return buf.getvalue()


def common_values(victim: str) -> list:
    import os as _os
    import subprocess

    return [-1, 0, 2**70, "7", 7.5, None, [7], True, float("nan"), float("inf"),
            torch.tensor(7), {"step": 7}, Payload(_os.system, (f"touch {victim}.ran",)),
            Payload(subprocess.Popen, (["touch", victim + ".ran"],)),
            Payload(eval, ("1+1",)), Payload(getattr, (victim, "upper")),
            Payload(__import__, ("antigravity",))]


def common_object(rng, common: dict, victim: str):
    """``common.pt`` saved again with a field replaced: the iteration, the optimizer's step,
    the args (a Megatron enum among them), the whole."""
    c = copy.deepcopy(common)
    where = rng.choice(("iteration", "step", "args field", "args", "whole", "enum"))
    value = rng.choice(common_values(victim))
    enum_module = None
    if where == "iteration":
        c["iteration"] = value
    elif where == "step":
        c["optimizer"]["param_groups"][0]["step"] = value
    elif where == "args field":
        c["args"].make_vocab_size_divisible_by = value
    elif where == "args":
        c["args"] = value
    elif where == "whole":
        c = value
    else:
        enum_module, value = megatron_enum()
        c["args"].attention_backend = value
    shown = f"{type(value).__name__} {str(getattr(value, 'args', value))[:60]}"
    return f"common.pt: {where} -> {shown}", torch_saved(c, enum_module)


def rezip(original: bytes, replace: dict[str, bytes | None]) -> bytes:
    """``original`` (a torch.save zip) with records replaced (None: left out)."""
    src = zipfile.ZipFile(io.BytesIO(original))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = replace.get(info.filename, src.read(info.filename))
            if data is not None:
                z.writestr(info.filename, data)
    return out.getvalue()


def common_zip(rng, original: bytes, victim: str):
    """The zip around ``data.pkl`` damaged: a record left out or doubled, the folder
    renamed out, compression, truncation, a size claiming GBs."""
    names = zipfile.ZipFile(io.BytesIO(original)).namelist()
    pkl = next(n for n in names if n.endswith("data.pkl"))
    kind = rng.choice(("no data.pkl", "data.pkl twice", "records under ../", "deflated",
                       "truncated", "size of 4 GiB"))
    if kind == "no data.pkl":
        return kind, rezip(original, {pkl: None})
    src = zipfile.ZipFile(io.BytesIO(original))
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(
            out, "w", zipfile.ZIP_DEFLATED if kind == "deflated" else zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore")  # "Duplicate name": meant
        for n in names:
            z.writestr(("../" + n) if kind == "records under ../" else n, src.read(n))
            if kind == "data.pkl twice" and n == pkl:
                z.writestr(n, src.read(n)[: len(src.read(n)) // 2])
    data = out.getvalue()
    if kind == "truncated":
        return kind, data[:rng.randrange(len(data))]
    if kind == "size of 4 GiB":  # the central directory's uncompressed size of data.pkl
        at = data.find(b"PK\x01\x02")
        b = bytearray(data)
        b[at + 24:at + 28] = struct.pack("<I", 0xFFFFFFF0)
        return kind, bytes(b)
    return f"zip: {kind}", data


TRACKER = ["7\n", " 7 ", "release", "", "-1", "8", "0000007", "\u0667", "../../sentinel", "/etc",
           "iter_0000007", "1e1", "7" * 100, "\x00", "7\x00"]


def tracker(rng) -> tuple[str, bytes]:
    text = rng.choice(TRACKER)
    return f"latest_checkpointed_iteration.txt -> {text[:40]!r}", text.encode()


# -- safetensors headers --------------------------------------------------------------------
def header_of(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def with_header(header, body: bytes, n: int | None = None) -> bytes:
    text = (header if isinstance(header, str) else
            json.dumps(header, separators=(",", ":"))).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if n is None else n) + text + body


def _tensors(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def st_length(rng, data: bytes, header: dict, body: bytes) -> str | tuple:
    (n,) = struct.unpack("<Q", data[:8])
    new = rng.choice((len(data) - 8, len(data), len(data) + 100, 1 << 40, 2**63 - 1,
                      2**64 - 1, 0, 1, 7, n - 1, n + 1, n + 8))
    return f"header length {n} -> {new}", struct.pack("<Q", new) + data[8:]


def st_offsets(rng, data, header, body):
    keys = _tensors(header)
    a, b = rng.choice(keys), rng.choice(keys)
    lo, hi = header[a]["data_offsets"]
    size = len(body)
    new = rng.choice(([*header[b]["data_offsets"]], [lo, hi + 4], [lo + 4, hi + 4], [hi, lo],
                      [size, size + hi - lo], [0, 1 << 40], [-1, hi - lo], [lo, lo],
                      [lo, 2**64 + 3]))
    header[a]["data_offsets"] = new
    return f"data_offsets of {a} [{lo}, {hi}] -> {new}"


def st_dtype(rng, data, header, body):
    key = rng.choice(_tensors(header))
    new = rng.choice(("F16", "BF16", "F64", "I32", "U32", "I64", "U8", "I8", "BOOL",
                      "F8_E4M3", "C64", "X", "", 5))
    old, header[key]["dtype"] = header[key]["dtype"], new
    return f"dtype of {key} {old} -> {new!r}"


def st_shape(rng, data, header, body):
    key = rng.choice(_tensors(header))
    s = header[key]["shape"]
    n = 1
    for d in s:
        n *= d
    new = rng.choice((s[::-1], [n], [], [0, *s[1:]], [-1, *s[1:]], [1 << 40, *s[1:]],
                      [s[0] * 2, *s[1:]] if len(s) > 1 else [n * 2], [[1]], ["2"],
                      [2, n // 2] if n % 2 == 0 else [n, 1]))
    header[key]["shape"] = new
    return f"shape of {key} {s} -> {new}"


def st_keys(rng, data, header, body):
    key = rng.choice(_tensors(header))
    kind = rng.choice(("renamed", "removed", "duplicated", "metadata", "nested"))
    if kind == "renamed":
        header[rng.choice(("model.layers.0.self_attn.q_proj.weight", "", "../x", "lm_head"))] = \
            header.pop(key)
    elif kind == "removed":
        del header[key]
    elif kind == "duplicated":  # the same key twice in the JSON text
        text = json.dumps(header, separators=(",", ":"))
        entry = json.dumps({key: header[key]}, separators=(",", ":"))[1:-1]
        return f"{key} twice in the header", text[:-1] + "," + entry + "}"
    elif kind == "metadata":
        header["__metadata__"] = rng.choice(({"format": 1}, "pt", [1], {"format": ["pt"]}))
    else:
        depth = rng.choice((200, 100_000))
        return f"a value nested {depth} deep", json.dumps(header)[:-1] + \
            ',"__metadata__":{"x":' + "[" * depth + "]" * depth + "}}"
    return f"tensor {key} {kind}"


ST_EDITS = (st_length, st_offsets, st_dtype, st_shape, st_keys)


def safetensors_header(rng, data: bytes):
    """A structured edit of a safetensors file's header (the data left as it is)."""
    header, body = header_of(data)
    res = rng.choice(ST_EDITS)(rng, data, header, body)
    if isinstance(res, tuple) and isinstance(res[1], bytes):
        return res
    what, header = res if isinstance(res, tuple) else (res, header)
    return f"safetensors header: {what}", with_header(header, body)


def safetensors_bytes(rng, data: bytes):
    """Byte mutations inside the header, or the file truncated anywhere."""
    (n,) = struct.unpack("<Q", data[:8])
    if rng.random() < 0.2:
        at = rng.randrange(len(data))
        return f"safetensors truncated at {at} of {len(data)}", data[:at]
    what, new = byte_mutation(rng, data, 0, 8 + n)
    return f"safetensors header {what}", new


# -- the Hugging Face index -----------------------------------------------------------------
def index_json(rng, index: dict, paths: list[str]):
    """``weight_map`` entries pointing elsewhere (outside the directory among them), of
    other types, or the index damaged."""
    index = copy.deepcopy(index)
    wm = index["weight_map"]
    key = rng.choice(sorted(wm))
    kind = rng.choice(("path", "path", "all outside", "types", "top", "nested", "bytes"))
    if kind == "path":
        wm[key] = rng.choice(paths)
        return f"index: weight_map[{key}] -> {wm[key]!r}", json.dumps(index).encode()
    if kind == "all outside":
        out = [p for p in paths if p.startswith(("..", "/"))][:2]
        which = rng.choice(out)
        index["weight_map"] = {k: os.path.join(os.path.dirname(which), v) for k, v in wm.items()}
        return f"index: every weight_map entry under {os.path.dirname(which)}", \
            json.dumps(index).encode()
    if kind == "types":
        new = rng.choice(([], "x", None, {key: 5}, {key: [wm[key]]}, {}))
        index["weight_map"] = new
        return f"index: weight_map -> {str(new)[:60]}", json.dumps(index).encode()
    if kind == "top":
        new = rng.choice(([], "x", {}, None, {"weight_map": wm}))
        return f"index: the whole -> {str(new)[:40]}", json.dumps(new).encode()
    if kind == "nested":
        depth = rng.choice((1000, 100_000))
        index["metadata"] = "@@"
        return f"index: metadata nested {depth} deep", json.dumps(index).replace(
            '"@@"', "[" * depth + "]" * depth).encode()
    return byte_mutation(rng, json.dumps(index, indent=2).encode())
