"""Restart from the freshest complete tier (``checkpoint.resume = "auto"`` with the local
tier on).

1. Every rank lists the shards its node holds (shards.inventory: its own node's copies and
   the partner copies written there for others, of this run only: a marker names the run's
   id; another run's shards are removed, torn ones named once in the log); rank 0 adds the
   newest HDF5 checkpoint of the run's trajectory. One ``allgather`` gives every rank every
   list.
2. :func:`agree` (pure, the same answer on every rank): the newest generation for which
   every saved rank's shard is held by some rank, if it is newer than the HDF5 file (or as
   new and loadable by each rank from its own file); which rank reads which shard.
3. The ranks check the CRC-32 of the shards they were given (one more ``allgather``); a bad
   one is dropped and step 2 repeated, so a half-written copy is never used.
4. Load. The same layout, every rank holding its own saved rank's shard with the very
   pieces it has now (every rank agrees): each rank reads its own file into its tensors.
   Otherwise (fewer ranks, another layout, a shard from a
   partner copy): the holders write the shards' pieces into one HDF5 checkpoint of the
   run's directory, in global shapes (the Writer of any save: checksums, commit), and every
   rank loads it the way any checkpoint loads on any layout.

When the newest HDF5 file turns out damaged (the restore falls back to an older one), the
local generations are asked again against the step actually restored. Generations newer than
the restart point are deleted when the next local generation is written, not before.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .layout import Piece
from .lineage import LineageError
from .shards import inventory, load_shard, remove, sound
from .write import Snapshot


def resharded(resumed: dict | None, dims) -> bool:
    """Whether a checkpoint restored from HDF5 was written on another grid."""
    saved = str((resumed or {}).get("topology", "") or "")
    return bool(saved) and saved != str(tuple(dims))


class LocalMismatch(LineageError):
    """A local generation that does not fit this model (refused like an HDF5 one)."""


def agree(invs: list[list[dict]], h5_step: int | None, world: int,
          dims: list[int]) -> dict | None:
    """The generation to restore from, or None when the HDF5 tier (or nothing) is at least
    as fresh. ``invs[c]``: what current rank c holds (shards.inventory rows). Returns
    ``{step, world, dims, holders: {saved rank: current rank}, fast, tier}``: ``fast`` when
    the layout is the same and every rank holds its own saved rank's shard; ``tier``
    "local" when every shard is read on its own node, else "partner"."""
    steps = sorted({e["step"] for inv in invs for e in inv}, reverse=True)
    for step in steps:
        rows = [(c, e) for c, inv in enumerate(invs) for e in inv if e["step"] == step]
        shapes = {(e["world"], tuple(e["dims"])) for _, e in rows}
        if len(shapes) != 1:
            continue  # two layouts wrote the same step: not one generation
        saved, sdims = shapes.pop()
        held: dict[int, list[tuple[int, bool]]] = {}
        for c, e in rows:
            held.setdefault(e["rank"], []).append((c, e["own"]))
        if set(held) != set(range(saved)):
            continue
        fast = saved == world and list(sdims) == list(dims) and all(
            any(c == r for c, _ in held[r]) for r in range(saved))
        if h5_step is not None and (step < h5_step or (step == h5_step and not fast)):
            return None
        holders, load = {}, [0] * len(invs)
        for r in range(saved):
            if fast:
                holders[r] = r
            else:  # an own copy first, then the least loaded holder, then the lowest rank
                c, _ = min(held[r], key=lambda x: (not x[1], load[x[0]], x[0]))
                holders[r] = c
            load[holders[r]] += 1
        own = all(any(c == holders[r] and o for c, o in held[r]) for r in range(saved))
        return {"step": step, "world": saved, "dims": list(sdims), "holders": holders,
                "fast": fast, "tier": "local" if own else "partner"}
    return None


def choose(world, mine: list[dict], h5_step: int | None, dims) -> tuple[dict | None, list]:
    """Steps 1-3 of the module docstring. Collective over ``world``. Returns (the choice or
    None, the shards dropped for a bad CRC)."""
    invs = world.allgather_obj(mine)
    dropped: list[str] = []
    while True:
        choice = agree(invs, h5_step, world.size, list(dims))
        if choice is None:
            return None, dropped
        files = {e["file"] for e in mine if e["step"] == choice["step"]
                 and choice["holders"].get(e["rank"]) == world.rank}
        checked = [(world.rank, f, sound(f)) for f in sorted(files)]
        bad = [b for part in world.allgather_obj([c for c in checked if c[2]]) for b in part]
        if not bad:
            return choice, dropped
        gone = {(c, f) for c, f, _ in bad}
        dropped += [why for _, _, why in bad]
        invs = [[e for e in inv if (c, e["file"]) not in gone] for c, inv in enumerate(invs)]
        mine = invs[world.rank]


def _mine(mine: list[dict], choice: dict, rank: int) -> list[str]:
    """The shard files this rank reads for ``choice`` (own node's copy first)."""
    out = {}
    for e in sorted(mine, key=lambda e: not e["own"]):
        if e["step"] == choice["step"] and choice["holders"][e["rank"]] == rank:
            out.setdefault(e["rank"], e["file"])
    return [out[r] for r in sorted(out)]


def fit(world, saved: dict, current: dict) -> list[str]:
    """Problems (the same list on every rank) when the generation's datasets (``saved``,
    every holder's {path: shape}) do not fit this model (``current``, each rank's). One
    allgather."""
    parts = world.allgather_obj((saved, current))
    have = {k: v for s, _ in parts for k, v in s.items()}
    want = {k: v for _, c in parts for k, v in c.items()}
    out = [f"the local generation has no dataset {p}" for p in sorted(set(want) - set(have))]
    out += [f"{p}: saved shape {tuple(have[p])} != model shape {tuple(want[p])}"
            for p in sorted(set(want) & set(have)) if tuple(have[p]) != tuple(want[p])]
    out += [f"this model has no parameter {p}" for p in sorted(set(have) - set(want))
            if p.startswith("model/")]
    return out


def _own_fits(file: str, pieces: dict[str, Piece]) -> bool:
    """Whether this rank's own shard holds exactly the pieces it has now (the same grid
    can cut them otherwise: pipeline boundaries, schedule, virtual stages, buckets)."""
    marker, _ = load_shard(file)
    saved = {p["path"]: p["boxes"] for p in marker["pieces"]}
    return all(piece.parts == [] or saved.get(path) == [[list(s), list(c)] for _, (s, c) in
                                                         piece.parts]
               for path, piece in pieces.items()) and "rng/torch" in saved


def load_own(file: str, pieces: dict[str, Piece]) -> dict:
    """Same layout: copy this rank's own shard into its tensors (the RNG state too);
    returns the marker."""
    marker, arrays = load_shard(file)
    for path, piece in pieces.items():
        if not piece.parts:
            continue
        saved = next(p for p in marker["pieces"] if p["path"] == path)
        boxes = [[list(s), list(c)] for _, (s, c) in piece.parts]
        if saved["boxes"] != boxes:
            raise LocalMismatch(f"{file}: {path} holds other elements than this rank's")
        piece.scatter(np.array(arrays[path]))
    torch.set_rng_state(pieces["rng/torch"].tensor)
    return marker


def assembled(files: list[str], step: int, meta: dict) -> Snapshot:
    """The pieces of ``files`` that the HDF5 file takes from them (``writes``), merged per
    dataset, as a snapshot for the Writer."""
    pieces: dict[str, Piece] = {}
    bufs: dict[str, list] = {}
    for f in files:
        marker, arrays = load_shard(f)
        for p in marker["pieces"]:
            if not p["writes"]:
                continue
            piece = pieces.setdefault(p["path"], Piece(
                p["path"], tuple(p["shape"]), np.dtype(p["dtype"]), None, True))
            piece.parts += [(None, (tuple(s), tuple(c))) for s, c in p["boxes"]]
            bufs.setdefault(p["path"], []).append(arrays[p["path"]])
    return Snapshot(step, pieces, {k: np.concatenate(v) for k, v in bufs.items()}, {}, meta)


def shapes_of(files: list[str]) -> dict[str, list]:
    out = {}
    for f in files:
        marker, _ = load_shard(f)
        out.update({p["path"]: p["shape"] for p in marker["pieces"] if p["writes"]})
    return out


def meta_of(files: list[str]) -> dict | None:
    """Saved rank 0's file attributes when this rank reads its shard."""
    for f in files:
        marker, _ = load_shard(f)
        if marker["rank"] == 0:
            return marker["meta"]
    return None


def restore(tier, named_params, optimizer) -> dict | None:
    """Restore from the freshest complete tier; the resumed attributes (plus ``path``,
    ``continues``: the HDF5 file the trajectory goes on from) or None for a fresh start.
    Records ``tier.recovery`` and logs it. Collective over the world."""
    t0, saver, world = time.perf_counter(), tier.saver, tier.topo.world
    from .checkpointer import candidates

    h5 = candidates("auto", saver.dir) if world.rank == 0 else []
    h5 = world.bcast_obj([str(p) for p in h5])
    h5_step = int(Path(h5[0]).stem[5:]) if h5 else None
    mine = _inventory(tier)
    choice, dropped = choose(world, mine, h5_step, tier.dims)
    resumed, what = None, choice["tier"] if choice else "hdf5"
    if choice is None:
        resumed = saver.restore("auto", named_params, optimizer)
        got = int(resumed["step"]) if resumed else None
        if h5_step is not None and got != h5_step:  # the newest file was damaged
            choice, more = choose(world, mine, got, tier.dims)
            dropped += more
            what = choice["tier"] if choice else what
            h5 = [resumed["path"]] if resumed else []  # what the trajectory goes on from
    if dropped and world.rank == 0:
        tier.warn(f"local tier: {len(dropped)} shard(s) fail their check and are not used "
                  f"({'; '.join(dropped[:3])})")
    if choice is not None:
        resumed = _from_local(tier, choice, mine, h5, named_params, optimizer)
    step = int(resumed["step"]) if resumed else 0
    tier.stale_after = step  # newer generations go when the next one is written
    dt = time.perf_counter() - t0
    tier.recovery = {"tier": what if resumed else "none", "step": step, "recovery_s": dt,
                     "path": resumed["path"] if resumed else None,
                     "reshard": (not choice["fast"]) if choice else resharded(resumed,
                                                                               tier.dims)}
    if resumed and world.rank == 0:
        tier.info(f"restart: tier {what}, step {step}, from {resumed['path']}, "
                  f"{dt:.2f} s to recover")
    return resumed


def _inventory(tier) -> list[dict]:
    """This node's shards of this run (shards.inventory); another run's are removed and
    the torn ones named, once in the log (rank 0, every node's). Collective."""
    mine, torn, foreign = inventory(tier.folder, tier.host, tier.run_id)
    if tier.topo.node_comm.rank != 0:
        foreign = []  # the node's folder: its first rank removes them
    remove(foreign)
    parts = tier.topo.world.allgather_obj((torn, len(foreign)))
    if tier.topo.world.rank == 0:
        torn = sorted({t for part, _ in parts for t in part})
        if torn:
            tier.warn(f"local tier: {len(torn)} torn shard(s) not used: {'; '.join(torn[:4])}")
        n = sum(k for _, k in parts)
        if n:
            tier.info(f"local tier: removed {n} file(s) of another run from {tier.folder} "
                      f"(their markers name another run id than this run's {tier.run_id})")
    return mine


def _from_local(tier, choice, mine, h5, named_params, optimizer) -> dict:
    saver, world = tier.saver, tier.topo.world
    files = _mine(mine, choice, world.rank)
    pieces = saver.pieces(named_params, optimizer)
    current = {p: list(pc.global_shape) for p, pc in pieces.items() if p != "rng/torch"}
    problems = fit(world, {k: v for k, v in shapes_of(files).items() if k != "rng/torch"},
                   current)
    if problems:
        raise LocalMismatch(f"refusing to resume from the local generation of step "
                            f"{choice['step']} in {tier.folder}: it does not fit this model "
                            f"({len(problems)} problem(s): {'; '.join(problems[:3])})")
    metas = [m for m in world.allgather_obj(meta_of(files)) if m is not None]
    meta = metas[0]
    if choice["fast"]:  # only when every rank's own shard holds its very pieces
        choice["fast"] = world.allreduce(float(_own_fits(files[0], pieces)), "min") == 1.0
    if choice["fast"]:
        load_own(files[0], pieces)
        if hasattr(optimizer, "step_count"):
            optimizer.step_count = int(meta["optim_step"])
        if getattr(optimizer, "scaler", None) is not None:
            optimizer.scaler.load_state_dict({k[len("loss_scaler_"):]: v for k, v in
                                              meta.items() if k.startswith("loss_scaler_")})
        return {**meta, "rng_restored": True, "path": str(Path(files[0]).parent),
                "continues": h5[0] if h5 else None}
    snap = assembled(files, choice["step"], meta)
    path = saver.writer.write(snap)["path"]
    return saver.restore(path, named_params, optimizer)
