"""The mutations of the foreign-checkpoint fuzz campaign (:mod:`benchmarks.fuzz_foreign`):
opcode-level mutations of a pickle (parsed with :func:`pickletools.genops`), byte-level
mutations of any file, and the hand-written pickle gadgets (BUILD on a class, ``__reduce__``
chains, reused memo entries, oversized lengths, deep nesting, SETITEM/APPEND on what is not
a container). Each takes a ``random.Random`` and returns ``(what it did, new bytes)``;
:mod:`benchmarks.fuzz_cases` says which file of which fixture gets which.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import pickletools
import struct
from dataclasses import dataclass

OPCODES = {o.name: o for o in pickletools.opcodes}
# names a mutated pickle asks for instead of a class of its format
DANGEROUS = [("os", "system"), ("posix", "system"), ("subprocess", "Popen"),
             ("subprocess", "check_output"), ("builtins", "eval"), ("builtins", "exec"),
             ("builtins", "getattr"), ("builtins", "setattr"), ("builtins", "__import__"),
             ("builtins", "open"), ("os", "remove"), ("shutil", "rmtree"),
             ("pathlib", "PosixPath"), ("pathlib", "Path"), ("pathlib", "PosixPath.unlink"),
             ("pathlib", "os.system"), ("torch.serialization", "os.system"), ("torch", "load"),
             ("pickle", "loads"), ("importlib", "import_module"), ("functools", "partial"),
             ("operator", "attrgetter"), ("runpy", "run_path"), ("nt", "system"),
             ("megatron.core.transformer.enums", "AttnBackend"), ("argparse", "Namespace"),
             ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
             ("torch._utils", "_rebuild_tensor_v2"), ("torch.serialization", "_get_layout"),
             ("torch.distributed.checkpoint.metadata", "Metadata")]
PALETTE = ["NONE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "MARK", "POP", "POP_MARK", "DUP",
           "BUILD", "REDUCE", "NEWOBJ", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "TUPLE1",
           "TUPLE2", "TUPLE3", "TUPLE", "LIST", "DICT", "STOP", "NEWTRUE", "MEMOIZE",
           "EMPTY_SET", "ADDITEMS", "FROZENSET", "STACK_GLOBAL"]
LENGTH_FIELD = {"unicodestring1": "<B", "unicodestring4": "<I", "unicodestring8": "<Q",
                "bytes1": "<B", "bytes4": "<I", "bytes8": "<Q", "string1": "<B",
                "string4": "<i", "long1": "<B", "long4": "<i"}
INTS = ("BININT1", "BININT2", "BININT", "LONG1")
STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")
GETS = ("BINGET", "LONG_BINGET")


@dataclass(frozen=True)
class Op:
    """One opcode of a pickle with its argument and its bytes."""

    name: str
    arg: object
    raw: bytes


def code(name: str) -> bytes:
    return OPCODES[name].code.encode("latin-1")


def parse(data: bytes) -> list[Op]:
    """The opcodes of pickle ``data``, FRAMEs left out (framing is optional: the pickle
    means the same without)."""
    items = list(pickletools.genops(data))
    out = []
    for i, (op, arg, pos) in enumerate(items):
        end = items[i + 1][2] if i + 1 < len(items) else pos + 1
        if op.name != "FRAME":
            out.append(Op(op.name, arg, data[pos:end]))
    return out


def dumps(ops) -> bytes:
    return b"".join(o.raw if isinstance(o, Op) else o for o in ops)


def fragment(obj, proto: int) -> list[bytes]:
    """The opcodes that push ``obj`` (classes by name, no memo), as bytes."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, proto)
    p.fast = True  # no memo: the fragment leaves the host pickle's memo indices alone
    p.dump(obj)
    return [o.raw for o in parse(buf.getvalue()) if o.name not in ("PROTO", "STOP")]


def string(s: str, proto: int) -> bytes:
    return fragment(s, proto)[0]


def global_op(module: str, name: str, proto: int) -> list[bytes]:
    """Push ``module.name`` (a class or function by name)."""
    if proto >= 4:
        return [string(module, 4), string(name, 4), code("STACK_GLOBAL")]
    return [code("GLOBAL") + f"{module}\n{name}\n".encode()]


def integer(v: int) -> bytes:
    if 0 <= v < 256:
        return code("BININT1") + bytes([v])
    if -2**31 <= v < 2**31:
        return code("BININT") + struct.pack("<i", v)
    raw = pickle.encode_long(v)
    return code("LONG1") + bytes([len(raw)]) + raw


def get_op(index: int) -> bytes:
    return code("BINGET") + bytes([index]) if index < 256 else \
        code("LONG_BINGET") + struct.pack("<I", index)


class PickleTarget:
    """A pickle to mutate: its opcodes, protocol, and the objects its memo holds (read from
    the unmutated file, which this campaign wrote)."""

    def __init__(self, label: str, data: bytes, persistent: bool = False):
        self.label, self.data, self.ops = label, data, parse(data)
        self.proto = self.ops[0].arg if self.ops[0].name == "PROTO" else 0
        u = pickle.Unpickler(io.BytesIO(data))
        if persistent:
            u.persistent_load = lambda pid: None
        self.obj = u.load()
        self.memo = u.memo.copy()

    def indices(self, names) -> list[int]:
        return [i for i, o in enumerate(self.ops) if o.name in names]

    def memo_of(self, test) -> list[int]:
        return sorted(k for k, v in self.memo.items() if test(v))

    def insert(self, at: int, frag: list[bytes]) -> bytes:
        return dumps(self.ops[:at] + list(frag) + self.ops[at:])

    def before_stop(self, frag: list[bytes]) -> bytes:
        return self.insert(len(self.ops) - 1, frag)


# -- opcode level ---------------------------------------------------------------------------
def op_delete(rng, t: PickleTarget):
    i, n = rng.randrange(1, len(t.ops)), rng.choice((1, 1, 1, 2, 3))
    return f"deleted {n} opcode(s) from #{i} ({t.ops[i].name})", dumps(t.ops[:i] + t.ops[i + n:])


def op_duplicate(rng, t: PickleTarget):
    i = rng.randrange(1, len(t.ops))
    return f"duplicated opcode #{i} ({t.ops[i].name})", t.insert(i, [t.ops[i]])


def op_swap(rng, t: PickleTarget):
    i = rng.randrange(1, len(t.ops) - 1)
    j = i + 1 if rng.random() < 0.5 else rng.randrange(1, len(t.ops))
    ops = list(t.ops)
    ops[i], ops[j] = ops[j], ops[i]
    return f"swapped opcodes #{i} ({t.ops[i].name}) and #{j} ({t.ops[j].name})", dumps(ops)


def op_insert(rng, t: PickleTarget):
    i, name = rng.randrange(1, len(t.ops)), rng.choice(PALETTE)
    return f"inserted {name} at #{i}", t.insert(i, [code(name)])


def op_replace(rng, t: PickleTarget):
    i, name = rng.randrange(1, len(t.ops)), rng.choice(PALETTE)
    ops = list(t.ops)
    ops[i] = code(name)
    return f"replaced opcode #{i} ({t.ops[i].name}) by {name}", dumps(ops)


def op_global(rng, t: PickleTarget):
    """A class the file names replaced by a dangerous name (the memo keeps it for every
    later use of the class)."""
    i = rng.choice(t.indices(("GLOBAL", "STACK_GLOBAL")))
    module, name = rng.choice(DANGEROUS)
    new = global_op(module, name, 2 if t.ops[i].name == "GLOBAL" else 4)
    if t.ops[i].name == "STACK_GLOBAL":  # drop the two names pushed for the old one
        new = [code("POP"), code("POP"), *new]
    ops = list(t.ops)
    ops[i:i + 1] = new
    return f"{t.ops[i].name} #{i} ({t.ops[i].arg or 'by name'}) -> {module}.{name}", dumps(ops)


def op_length(rng, t: PickleTarget):
    """A length-prefixed argument's length changed, its bytes kept."""
    i = rng.choice([k for k, o in enumerate(t.ops)
                    if OPCODES[o.name].arg and OPCODES[o.name].arg.name in LENGTH_FIELD])
    op = t.ops[i]
    fmt = LENGTH_FIELD[OPCODES[op.name].arg.name]
    width = struct.calcsize(fmt)
    (n,) = struct.unpack(fmt, op.raw[1:1 + width])
    top = 2 ** (8 * width - (1 if fmt.islower() else 0)) - 1
    new = min(top, rng.choice((n - 1, n + 1, 0, rng.randrange(2 * n + 2), top, top // 2)))
    new = max(new, -top - 1)
    raw = op.raw[:1] + struct.pack(fmt, new) + op.raw[1 + width:]
    ops = list(t.ops)
    ops[i] = raw
    return f"{op.name} #{i}: length {n} -> {new}", dumps(ops)


def op_int(rng, t: PickleTarget):
    """An integer (a size, an offset, a step) changed."""
    i = rng.choice(t.indices(INTS))
    v = int(t.ops[i].arg)
    new = rng.choice((0, 1, -1, v - 1, v + 1, 2 * v, v // 2, 2**31 - 1, -2**31, 2**63,
                      rng.randrange(4096)))
    ops = list(t.ops)
    ops[i] = integer(new)
    return f"{t.ops[i].name} #{i}: {v} -> {new}", dumps(ops)


def op_memo(rng, t: PickleTarget):
    """A memo reference pointed at another entry (or past the memo)."""
    i = rng.choice(t.indices(GETS))
    new = rng.choice(list(t.memo)) if rng.random() < 0.9 else len(t.memo) + 1000
    ops = list(t.ops)
    ops[i] = get_op(new)
    return f"{t.ops[i].name} #{i}: memo {t.ops[i].arg} -> {new}", dumps(ops)


def op_string(rng, t: PickleTarget, interesting: list[str]):
    """A string (a key, a class name, a path) replaced by an interesting one or edited."""
    i = rng.choice(t.indices(STRINGS + ("BINUNICODE", "SHORT_BINSTRING", "BINSTRING")))
    old = str(t.ops[i].arg)
    if rng.random() < 0.5 and old:
        k = rng.randrange(len(old))
        new = old[:k] + chr(rng.choice((0, 46, 47, 48, 97, 0x7f, 0x430))) + old[k + 1:]
    else:
        new = rng.choice(interesting)
    ops = list(t.ops)
    ops[i] = string(new, max(t.proto, 2))
    return f"string #{i} {old[:60]!r} -> {new[:80]!r}", dumps(ops)


OPCODE_MUTATIONS = (op_delete, op_duplicate, op_swap, op_insert, op_replace, op_global,
                    op_length, op_int, op_memo)


# -- byte level -----------------------------------------------------------------------------
def byte_mutation(rng, data: bytes, lo: int = 0, hi: int | None = None):
    """Flip bits, set, insert, delete or duplicate bytes within ``data[lo:hi]``, or
    truncate there."""
    hi = len(data) if hi is None else min(hi, len(data))
    at = rng.randrange(lo, max(hi, lo + 1))
    kind = rng.choice(("flip", "flip", "set", "truncate", "insert", "delete", "duplicate"))
    b = bytearray(data)
    n = rng.choice((1, 1, 2, 4, 16))
    if kind == "flip":
        for _ in range(n):
            k = rng.randrange(lo, max(hi, lo + 1))
            b[k] ^= 1 << rng.randrange(8)
    elif kind == "set":
        b[at:at + n] = bytes(rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
                             for _ in range(min(n, len(b) - at)))
    elif kind == "truncate":
        b = b[:at]
    elif kind == "insert":
        b[at:at] = bytes(rng.randrange(256) for _ in range(n))
    elif kind == "delete":
        del b[at:at + n]
    else:
        b[at:at] = b[at:at + n]
    return f"bytes: {kind} {n if kind != 'truncate' else ''} at {at} of {len(data)}", bytes(b)


# -- hand-written gadgets -------------------------------------------------------------------
def attack_states(victim: str) -> list[tuple[str, object]]:
    """BUILD states an attacker sets on a class: (label, state) with slot-state (the form
    that reaches ``setattr``) and dict-state forms."""
    od = collections.OrderedDict
    return [("_str -> victim", (None, {"_str": victim})),
            ("_str -> victim, mkdir -> OrderedDict", (None, {"_str": victim, "mkdir": od})),
            ("_str, _parts, _drv -> victim", (None, {"_str": victim, "_parts": [victim],
                                                     "_drv": "", "_root": "/"})),
            ("unlink -> OrderedDict", (None, {"unlink": od})),
            ("__eq__ -> set", (None, {"__eq__": set})),
            ("__init__ -> OrderedDict", (None, {"__init__": od})),
            ("__fspath__ -> str", (None, {"__fspath__": str})),
            ("cache -> {torch.strided: victim}", (None, {"cache": {"torch.strided": victim}})),
            ("dict state _str -> victim", {"_str": victim})]


def gadget_build_class(rng, t: PickleTarget, victim: str):
    """BUILD on a class (or function) the format admits: setattr on it, process-wide."""
    classes = [("pathlib", "PosixPath"), ("collections", "OrderedDict"), ("torch", "Size")]
    classes += [(v.__module__, v.__qualname__) for v in t.memo.values()
                if isinstance(v, type) or callable(v) and hasattr(v, "__qualname__")]
    module, name = classes[0] if rng.random() < 0.4 else rng.choice(classes)
    label, state = rng.choice(attack_states(victim))
    frag = [*global_op(module, name, t.proto), *fragment(state, t.proto), code("BUILD"),
            code("POP")]
    where = rng.choice(("start", "end"))
    data = t.insert(1, frag) if where == "start" else t.before_stop(frag)
    return f"BUILD on class {module}.{name} ({label}) at the {where}", data


def gadget_build_memo(rng, t: PickleTarget, victim: str):
    """BUILD on an object the file already made, taken from the memo: a class (reused
    memo entry) or an instance that is not a container."""
    picks = t.memo_of(lambda v: not isinstance(v, (dict, list)))
    k = rng.choice(picks)
    label, state = rng.choice(attack_states(victim))
    frag = [get_op(k), *fragment(state, t.proto), code("BUILD"), code("POP")]
    return f"BUILD on memo {k} ({type(t.memo[k]).__name__} {str(t.memo[k])[:50]}; " \
           f"{label})", t.before_stop(frag)


def reduce_chains(victim: str) -> list[tuple[tuple[str, str], tuple, tuple | None]]:
    """(callable, its arguments, the arguments of a call of its result or None)."""
    v, p = victim, pathlib.PosixPath(victim)
    return [(("pathlib", "PosixPath"), (v,), None),
            (("pathlib", "PosixPath.unlink"), (p,), None),
            (("pathlib", "Path.write_text"), (p, "overwritten"), None),
            (("pathlib", "PosixPath.rename"), (p, v + ".moved"), None),
            (("pathlib", "PosixPath.touch"), (pathlib.PosixPath(v + ".new"),), None),
            (("builtins", "getattr"), (p, "unlink"), ()),
            (("builtins", "eval"), (f"__import__('os').remove({v!r})",), None),
            (("posix", "system"), (f"touch {v}.ran",), None),
            (("subprocess", "Popen"), (["touch", v + ".ran"],), None),
            (("builtins", "__import__"), ("antigravity",), None),
            (("importlib", "import_module"), ("megatron.core",), None),
            (("torch.serialization", "_get_layout"), ("torch.strided",), ()),
            (("collections", "OrderedDict.fromkeys"), ([v],), None),
            (("torch", "Size"), ((2, 3),), ((1,),)),
            (("builtins", "set"), ([v],), ()),
            (("torch", "load"), (v,), None),
            (("pathlib", "os.system"), (f"touch {v}.ran",), None)]


def gadget_reduce(rng, t: PickleTarget, victim: str):
    """A ``__reduce__`` chain: call an admitted or dangerous callable, maybe call what it
    returns."""
    (module, name), args, then = rng.choice(reduce_chains(victim))
    frag = [*global_op(module, name, t.proto), *fragment(args, t.proto), code("REDUCE")]
    if then is not None:
        frag += [*fragment(then, t.proto), code("REDUCE")]
    frag.append(code("POP"))
    where = rng.choice(("start", "end"))
    data = t.insert(1, frag) if where == "start" else t.before_stop(frag)
    return f"REDUCE {module}.{name}{args!r:.80}{' then call it' if then is not None else ''} " \
           f"at the {where}", data


def oversized(proto: int) -> list[tuple[str, bytes]]:
    """Opcodes that claim GBs of data the file does not hold."""
    out = [("BINUNICODE of 2 GiB", code("BINUNICODE") + struct.pack("<I", 0x7FFFFFF0) + b"ab"),
           ("BINBYTES of 4 GiB", code("BINBYTES") + struct.pack("<I", 0xFFFFFFF0) + b"ab"),
           ("LONG4 of 2 GiB", code("LONG4") + struct.pack("<i", 0x7FFFFFF0) + b"\x01"),
           ("BINSTRING of 2 GiB", code("BINSTRING") + struct.pack("<i", 0x7FFFFFF0) + b"a")]
    if proto >= 4:
        out += [("BINUNICODE8 of 1 TiB", code("BINUNICODE8") + struct.pack("<Q", 1 << 40)),
                ("BINBYTES8 of 1 TiB", code("BINBYTES8") + struct.pack("<Q", 1 << 40)),
                ("FRAME of 1 TiB", code("FRAME") + struct.pack("<Q", 1 << 40))]
    if proto >= 5:
        out.append(("BYTEARRAY8 of 1 TiB", code("BYTEARRAY8") + struct.pack("<Q", 1 << 40)))
    return out


def gadget_oversized(rng, t: PickleTarget, victim: str):
    label, raw = rng.choice(oversized(t.proto))
    i = rng.choice([1, len(t.ops) - 1, rng.randrange(1, len(t.ops))])
    replace = rng.random() < 0.5 and t.ops[i].name in STRINGS
    ops = list(t.ops)
    ops[i:i + (1 if replace else 0)] = [raw]
    return f"{label} {'replacing' if replace else 'inserted before'} opcode #{i}", dumps(ops)


def nested(kind: str, depth: int) -> list[bytes]:
    """Opcodes of a value nested ``depth`` deep."""
    if kind == "list":
        return [code("EMPTY_LIST")] * depth + [code("APPEND")] * (depth - 1)
    if kind == "tuple":
        return [code("MARK")] * depth + [code("TUPLE")] * depth
    return [code("EMPTY_DICT"), string("k", 2)] * depth + [code("EMPTY_DICT")] + \
        [code("SETITEM")] * depth


def gadget_nesting(rng, t: PickleTarget, victim: str):
    """A value nested 1,000 to 1,000,000 deep put in the loaded object (BUILD on the
    instance the unpickler made; SETITEM on a dict), or marks never closed."""
    depth, kind = rng.choice((1000, 100_000, 1_000_000)), rng.choice(("list", "tuple", "dict"))
    if rng.random() < 0.15:
        return f"{depth} MARKs never closed", t.before_stop([code("MARK")] * depth)
    value = nested(kind, depth)
    if isinstance(t.obj, dict):
        frag = [string("nested", max(t.proto, 2)), *value, code("SETITEM")]
    else:
        frag = [code("EMPTY_DICT"), string("planner_data", max(t.proto, 2)), *value,
                code("SETITEM"), code("BUILD")]
    return f"{kind}s nested {depth} deep in the loaded object", t.before_stop(frag)


def gadget_not_container(rng, t: PickleTarget, victim: str):
    """SETITEM, SETITEMS, APPEND, APPENDS or ADDITEMS on an object that is not that
    container (a class, a tuple, a path, a dtype, the loaded object itself)."""
    picks = t.memo_of(lambda v: not isinstance(v, (dict, list)))
    target = rng.choice(["DUP", *picks])
    head = [code("DUP")] if target == "DUP" else [get_op(target)]
    key, value = fragment("_str", 2)[0], string(victim, max(t.proto, 2))
    op = rng.choice(("SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS"))
    body = {"SETITEM": [key, value, code("SETITEM")],
            "SETITEMS": [code("MARK"), key, value, code("SETITEMS")],
            "APPEND": [value, code("APPEND")],
            "APPENDS": [code("MARK"), value, code("APPENDS")],
            "ADDITEMS": [code("MARK"), value, code("ADDITEMS")]}[op]
    if op == "ADDITEMS" and t.proto < 4:
        body = [value, code("APPEND")]
    what = "the loaded object" if target == "DUP" else \
        f"memo {target} ({type(t.memo[target]).__name__})"
    return f"{op} on {what}", t.before_stop([*head, *body, code("POP")])


PICKLE_GADGETS = (gadget_build_class, gadget_build_memo, gadget_reduce, gadget_oversized,
                  gadget_nesting, gadget_not_container)
