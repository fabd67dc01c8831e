"""One rank's shard file of a local checkpoint generation, and where generations live.

A node-local directory (``checkpoint.local_dir``, ``{node}`` replaced by the host name) holds,
per run (``run_<hash of the checkpoint directory>``), one folder per generation::

    LOCAL/run_<id>/step_00000012/rank_00003.bin    saved rank 3's bytes, pieces one after another
    LOCAL/run_<id>/step_00000012/rank_00003.json   its marker: the pieces, CRC-32, size, step

A rank writes its own shard file and the partner copies it receives the same way: the bytes
as ``.rank_R.bin.tmp``, fsynced, renamed; then the marker as ``.rank_R.json.tmp``, fsynced,
renamed (and the folder fsynced). The marker is the commit: a shard counts only when its
marker is there, names the run, step and rank, and the ``.bin`` has the marker's size and
CRC-32. A copy killed while writing has no marker, or a ``.bin`` that fails the check.

A shard holds *every* piece the rank has (parameters, optimizer state, RNG), writer of the
HDF5 hyperslab or not (``writes`` in the marker), so that the same layout loads each rank's
own file alone; the pieces marked ``writes`` tile every global dataset once, so any set of
shards that covers every saved rank can be assembled into the HDF5 file's global shapes.
No MPI here.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import uuid
import zlib
from pathlib import Path

import numpy as np

from .. import faults
from .integrity import fsync_dir, fsync_file
from .layout import Piece

MARKER_FORMAT = "hpctrain-local-1"
RUN_ID = "run_id"  # in the checkpoint directory: the run's identity (run_identity)


def node_dir(template: str, host: str | None = None) -> Path:
    """``checkpoint.local_dir`` on this node: ``{node}`` becomes the host name."""
    return Path(template.replace("{node}", host or socket.gethostname()))


def run_dir(local: Path, ckpt_dir: Path) -> Path:
    """The folder of one run's generations: runs that share a node never mix."""
    digest = hashlib.sha1(str(Path(ckpt_dir).resolve()).encode()).hexdigest()[:12]
    return local / f"run_{digest}"


def gen_name(step: int) -> str:
    return f"step_{step:08d}"


def encode(pieces: dict[str, Piece], bufs: dict, writes: dict) -> tuple[list, list]:
    """(the marker's piece list, the buffers in file order) for every piece of a snapshot."""
    table, order, offset = [], [], 0
    for path, piece in pieces.items():
        if path not in bufs:
            continue
        buf = bufs[path]
        table.append({"path": path, "shape": list(piece.global_shape),
                      "dtype": piece.dtype.str, "writes": bool(writes[path]),
                      "boxes": [[list(s), list(c)] for _, (s, c) in piece.parts],
                      "offset": offset, "nbytes": int(buf.nbytes)})
        order.append(buf)
        offset += int(buf.nbytes)
    return table, order


def dumps(obj) -> str:
    """JSON of a marker (numpy numbers as plain ones)."""
    return json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o))


def crc_of(bufs) -> tuple[int, int]:
    crc, n = 0, 0
    for b in bufs:
        crc = zlib.crc32(memoryview(b).cast("B"), crc)
        n += b.nbytes
    return crc, n


def write_shard(folder: Path, marker: dict, bufs, killer: int | None = None) -> None:
    """Write one shard (own or a partner's) with the commit protocol of the module
    docstring. ``killer``: this process's world rank, for the fault injection that kills
    it halfway through the bytes (``local_kill``, hpctrain.faults)."""
    if killer is not None and faults.find("local_fail", killer, marker["step"]):
        raise OSError(errno.ENOSPC, f"fault injection: rank {killer} cannot write its local "
                      f"shard of step {marker['step']}")
    folder.mkdir(parents=True, exist_ok=True)
    name = f"rank_{marker['rank']:05d}"
    tmp, final = folder / f".{name}.bin.tmp", folder / f"{name}.bin"
    (folder / f"{name}.json").unlink(missing_ok=True)  # an older commit of this shard
    with open(tmp, "wb") as fh:
        for i, b in enumerate(bufs):
            if killer is not None and i == len(bufs) // 2 and faults.find(
                    "local_kill", killer, marker["step"]):
                fh.flush()
                os.replace(tmp, final)  # the worst case: the bytes half there, final name
                faults.die(f"rank {killer} killed while writing local shard {final}")
            fh.write(memoryview(b).cast("B"))
    fsync_file(tmp)
    os.replace(tmp, final)
    mtmp = folder / f".{name}.json.tmp"
    mtmp.write_text(dumps(marker))
    fsync_file(mtmp)
    os.replace(mtmp, folder / f"{name}.json")
    fsync_dir(folder)


def read_marker(path: Path) -> dict | None:
    """A committed marker, or None (absent, torn, not ours)."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == MARKER_FORMAT else None


def inventory(folder: Path, host: str, run: str) -> tuple[list[dict], list[str], list[str]]:
    """What this node holds of run ``run``: (every committed shard ``{step, rank, world,
    dims, own, file}``: a marker of this run whose ``.bin`` has the recorded size, the CRC is
    checked by :func:`sound`; the shards that are torn, each as "step S rank R: why"; the
    shard files of another run, whose markers name another run id or none)."""
    out: list[dict] = []
    torn: list[str] = []
    foreign: list[str] = []
    if not folder.is_dir():
        return out, torn, foreign
    for gen in sorted(folder.glob("step_*")):
        for name in sorted({p.name.lstrip(".").split(".")[0] for p in gen.glob("*rank_*")}):
            shard = _shard(gen, name, host, run)
            if isinstance(shard, dict):
                out.append(shard)
            elif shard.startswith("another run"):
                foreign += [str(p) for p in gen.glob(f"*{name}.*")]
            else:
                torn.append(f"step {int(gen.name[5:])} rank {int(name[5:])}: {shard}")
    return out, torn, foreign


def _shard(gen: Path, name: str, host: str, run: str) -> dict | str:
    """The inventory row of shard ``name`` (``rank_R``) of one generation folder, or why it
    is not one."""
    mpath, bin_ = gen / f"{name}.json", gen / f"{name}.bin"
    m = read_marker(mpath)
    if m is None:
        return ("no committed marker (the write was cut short)" if bin_.exists() or
                (gen / f".{name}.bin.tmp").exists() else "a marker that cannot be read")
    if m.get("run") != run:
        return f"another run ({m.get('run') or 'no run id'})"
    if not bin_.is_file() or bin_.stat().st_size != m["bytes"]:
        size = bin_.stat().st_size if bin_.is_file() else 0
        return f"{size} bytes, the marker records {m['bytes']}"
    return {"step": int(m["step"]), "rank": int(m["rank"]), "world": int(m["world"]),
            "dims": list(m["dims"]), "own": m.get("node") == host, "file": str(bin_)}


def remove(files: list[str]) -> None:
    """Delete shard files (of another run), then the generation folders left empty."""
    for f in files:
        Path(f).unlink(missing_ok=True)
    for gen in {Path(f).parent for f in files}:
        if gen.is_dir() and not any(gen.iterdir()):
            shutil.rmtree(gen, ignore_errors=True)


def run_identity(ckpt_dir: Path) -> str:
    """The id of the run whose checkpoints go to ``ckpt_dir``, created with it (rank 0
    only): every local marker carries it, so a new run in a reused path never takes an
    earlier run's generations."""
    path = Path(ckpt_dir) / RUN_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RUN_ID}.tmp")
        tmp.write_text(uuid.uuid4().hex + "\n")
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return path.read_text().strip()


def sound(file: str) -> str:
    """"" when the shard's bytes match its marker's CRC-32, else why not."""
    m = read_marker(Path(file).with_suffix(".json"))
    if m is None:
        return f"{file}: no committed marker"
    crc = 0
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return "" if crc == m["crc32"] else f"{file}: CRC-32 {crc:#010x} != {m['crc32']:#010x}"


def load_shard(file: str) -> tuple[dict, dict]:
    """(marker, {path: 1-D array}) of one shard, the arrays over one memory map."""
    m = read_marker(Path(file).with_suffix(".json"))
    assert m is not None, file
    raw = np.memmap(file, dtype=np.uint8, mode="r") if m["bytes"] else np.empty(0, np.uint8)
    return m, {p["path"]: raw[p["offset"]:p["offset"] + p["nbytes"]].view(np.dtype(p["dtype"]))
               for p in m["pieces"]}


def prune(folder: Path, keep_from: int) -> None:
    """Delete the generations older than step ``keep_from`` (at most ``local_keep`` stay)."""
    for gen in folder.glob("step_*"):
        if int(gen.name[5:]) < keep_from:
            shutil.rmtree(gen, ignore_errors=True)


def drop_newer(folder: Path, step: int) -> None:
    """Delete generations newer than ``step``: a restart from ``step`` abandons them."""
    for gen in folder.glob("step_*"):
        if int(gen.name[5:]) > step:
            shutil.rmtree(gen, ignore_errors=True)
