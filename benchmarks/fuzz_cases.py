"""The cases of the foreign-checkpoint fuzz campaign: which fixture file (of
:mod:`benchmarks.fuzz_fixtures`) gets which mutation (:mod:`benchmarks.fuzz_mutations`,
:mod:`benchmarks.fuzz_formats`). Case ``i`` of seed ``s`` is drawn from its own
``random.Random(f"{s}/{i}")``, so a case is the same whichever worker runs it and whatever
ran before; only the paths an attack aims at (the worker's sentinel tree) differ.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from . import fuzz_formats as ff
from . import fuzz_mutations as fm
from .fuzz_fixtures import MEGATRON_ITER, Fixture

INDEX = "model.safetensors.index.json"
DISTCP = "__0_0.distcp"
META = {"titan": ".metadata", "megatron": f"{MEGATRON_ITER}/.metadata"}
COMMON = f"{MEGATRON_ITER}/common.pt"
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Context:
    """Where a case's copy of its fixture lies (``source``) and what outside it an attack
    aims at: ``victim``, a file of the sentinel tree, and ``decoys``, the same checkpoints
    with other values (``decoys/<kind>``)."""

    source: Path
    victim: Path
    decoys: Path

    def paths(self, kind: str, name: str, inside: str) -> list[str]:
        """Paths a crafted file may name instead of ``name`` (a file of fixture ``kind``
        under ``inside``, a directory of the source): the decoy's copy of it, absolute and
        relative, system files, and paths that stay inside (accepted as the same file)."""
        here = self.source / inside
        decoy = self.decoys / kind / inside / name
        return [str(decoy), os.path.relpath(decoy, here), "/etc/passwd", "/dev/zero",
                "/dev/stdin", f"../{name}", ".", "", f"sub/../{name}", f"{name}\x00x",
                str(self.victim), os.path.relpath(self.victim, here),
                f"./{name}", str(here / name)]


@dataclass
class Case:
    """One case: the fixture ``kind``, the mutation's ``family`` and description, and the
    files of the fixture it replaces (relative path -> bytes; None: removed; ``("truncate",
    n)``: cut to n bytes)."""

    index: int
    kind: str
    family: str
    what: str
    files: dict[str, bytes | None] = field(default_factory=dict)


class Targets:
    """The fixtures' mutable files, read and parsed once."""

    def __init__(self, fixtures: dict[str, Fixture]):
        self.meta = {k: fm.PickleTarget(f"{k} .metadata",
                                        (fixtures[k].path / META[k]).read_bytes())
                     for k in ("titan", "megatron")}
        self.common_zip = (fixtures["megatron"].path / COMMON).read_bytes()
        import io
        import zipfile

        z = zipfile.ZipFile(io.BytesIO(self.common_zip))
        self.pkl_name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        self.common = fm.PickleTarget("common.pt data.pkl", z.read(self.pkl_name),
                                      persistent=True)
        hf = fixtures["hf"].path
        self.shards = {p.name: p.read_bytes() for p in sorted(hf.glob("*.safetensors"))}
        import json

        self.index = json.loads((hf / INDEX).read_text())
        self.sizes = {k: (fixtures[k].path / META[k]).with_name(DISTCP).stat().st_size
                      for k in ("titan", "megatron")}

    def common_file(self, pkl: bytes) -> bytes:
        return ff.rezip(self.common_zip, {self.pkl_name: pkl})


# -- families: (rng, targets, ctx) -> (kind, family, what, files) ---------------------------
def _pickle_case(rng, t: fm.PickleTarget, family: str, ctx: Context, kind: str):
    """An opcode-level or byte-level mutation, or a pickle gadget, of pickle ``t`` of a
    fixture ``kind`` (strings it may put in: paths beside that fixture's .distcp)."""
    inside = os.path.dirname(META[kind])
    if family == "opcode":
        mutation = rng.choice(fm.OPCODE_MUTATIONS + (fm.op_string,))
        if mutation is fm.op_string:
            return mutation(rng, t, ctx.paths(kind, DISTCP, inside))
        return mutation(rng, t)
    if family == "bytes":
        return fm.byte_mutation(rng, t.data)
    return rng.choice(fm.PICKLE_GADGETS)(rng, t, str(ctx.victim))


def dcp_metadata(rng, tg: Targets, ctx: Context, kind: str, family: str):
    t = tg.meta[kind]
    if family == "object":
        inside = os.path.dirname(META[kind])
        what, data = ff.dcp_object(rng, t.obj, ctx.paths(kind, DISTCP, inside))
    else:
        what, data = _pickle_case(rng, t, family, ctx, kind)
    return kind, family, f"{META[kind]}: {what}", {META[kind]: data}


def common_pt(rng, tg: Targets, ctx: Context, family: str):
    """Megatron's common.pt: its data.pkl mutated (and zipped again), or (gadgets) saved
    again with a field replaced or its zip damaged, or (bytes) the zip's bytes mutated."""
    choice = rng.random()
    if family == "gadget" and choice < 0.35:
        what, data = ff.common_object(rng, tg.common.obj, str(ctx.victim))
    elif family == "gadget" and choice < 0.5:
        what, data = ff.common_zip(rng, tg.common_zip, str(ctx.victim))
    elif family == "bytes" and choice < 0.2:
        what, data = fm.byte_mutation(rng, tg.common_zip)
        what = f"the zip's {what}"
    else:
        what, pkl = _pickle_case(rng, tg.common, family, ctx, "megatron")
        what, data = f"data.pkl {what}", tg.common_file(pkl)
    return "megatron", family, f"common.pt: {what}", {COMMON: data}


def megatron_files(rng, tg: Targets, ctx: Context):
    """The tracker, or a .distcp file truncated or removed (either DCP fixture)."""
    if rng.random() < 0.3:
        what, data = ff.tracker(rng)
        return "megatron", "gadget", what, {TRACKER: data}
    kind = rng.choice(("titan", "megatron"))
    name = os.path.join(os.path.dirname(META[kind]), DISTCP)
    size = tg.sizes[kind]
    at = rng.choice((0, rng.randrange(size), size - 1, None))
    if at is None:
        return kind, "gadget", f"{name} removed", {name: None}
    return kind, "gadget", f"{name} truncated at {at} of {size}", {name: ("truncate", at)}


def hf_shard(rng, tg: Targets, ctx: Context, family: str):
    name = rng.choice(sorted(tg.shards))
    edit = ff.safetensors_header if family == "gadget" else ff.safetensors_bytes
    what, data = edit(rng, tg.shards[name])
    return "hf", family, f"{name}: {what}", {name: data}


def hf_index(rng, tg: Targets, ctx: Context):
    shard = rng.choice(sorted(tg.shards))
    paths = ctx.paths("hf", shard, ".") + ["config.json", "missing.safetensors",
                                           rng.choice(sorted(tg.shards))]
    what, data = ff.index_json(rng, tg.index, paths)
    return "hf", "gadget", what, {INDEX: data}


def control(rng, tg: Targets, ctx: Context):
    """Files rewritten without changing what they mean: each must import as the same
    model (a check of the oracle itself)."""
    kind = rng.choice(("titan", "megatron", "common", "hf"))
    if kind in tg.meta:
        t = tg.meta[kind]
        return kind, "control", f"{META[kind]} without FRAMEs", {META[kind]: fm.dumps(t.ops)}
    if kind == "common":
        return "megatron", "control", "common.pt zipped again", \
            {COMMON: tg.common_file(tg.common.data)}
    name = rng.choice(sorted(tg.shards))
    header, body = ff.header_of(tg.shards[name])
    return "hf", "control", f"{name}: header written again, keys reversed", \
        {name: ff.with_header(dict(reversed(list(header.items()))), body)}


# (weight, family): what each case is drawn from
FAMILIES = [
    (16, lambda r, t, c: dcp_metadata(r, t, c, "titan", "opcode")),
    (8, lambda r, t, c: dcp_metadata(r, t, c, "titan", "bytes")),
    (8, lambda r, t, c: dcp_metadata(r, t, c, "titan", "gadget")),
    (7, lambda r, t, c: dcp_metadata(r, t, c, "titan", "object")),
    (5, lambda r, t, c: dcp_metadata(r, t, c, "megatron", "opcode")),
    (3, lambda r, t, c: dcp_metadata(r, t, c, "megatron", "bytes")),
    (3, lambda r, t, c: dcp_metadata(r, t, c, "megatron", "gadget")),
    (3, lambda r, t, c: dcp_metadata(r, t, c, "megatron", "object")),
    (7, lambda r, t, c: common_pt(r, t, c, "opcode")),
    (5, lambda r, t, c: common_pt(r, t, c, "bytes")),
    (7, lambda r, t, c: common_pt(r, t, c, "gadget")),
    (3, megatron_files),
    (8, lambda r, t, c: hf_shard(r, t, c, "gadget")),
    (7, lambda r, t, c: hf_shard(r, t, c, "bytes")),
    (7, hf_index),
    (2, control),
]


def draw(index: int, seed: int, targets: Targets, ctx: Context) -> Case:
    """Case ``index`` of campaign ``seed``."""
    rng = random.Random(f"{seed}/{index}")
    weights, makers = zip(*FAMILIES)
    make = rng.choices(makers, weights)[0]
    kind, family, what, files = make(rng, targets, ctx)
    return Case(index, kind, family, what, files)
