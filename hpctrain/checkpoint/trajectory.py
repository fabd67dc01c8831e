"""Which checkpoints of a directory belong to the run being trained: the commit log.

A checkpoint directory holds one *trajectory*: the checkpoints of one line of training, in
the order they were committed. ``DIR/commits.jsonl`` records it, one JSON object a line,
appended (and fsynced) by rank 0 only:

- ``{"event": "commit", "file": "step_N.h5", ...}`` at every commit, just before the file is
  renamed into place and ``latest`` repointed (a crash between the two leaves a line naming
  a file that is not there, which is ignored);
- ``{"event": "start", "from": "step_S.h5" | null, "set_aside": [...], "to": "..."}`` when a
  run starts: it continues the trajectory up to ``from`` (a file of the directory no
  commit names starts a trajectory; null: a new, empty one), and
  every other ``step_*.h5`` of the directory (the newer ones of an abandoned trajectory,
  files no log names) was moved into ``DIR/abandoned/<to>/`` first.

:func:`trajectory` replays the log: the names of the current trajectory's files, oldest
first, that exist. Retention (write.py) deletes only the oldest of these, and
``resume = "auto"`` falls back only along them. A directory without the log (written
before it existed), or whose log names none of its files, is one trajectory in step order;
the first event written seeds a missing log with it. No MPI here: the Checkpointer calls
these on rank 0.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .integrity import fsync_dir, write_durably

LATEST = "latest"
LOG = "commits.jsonl"
ASIDE = "abandoned"


def _present(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("step_*.h5"))


def trajectory(directory) -> list[str]:
    """The current trajectory's checkpoint file names, oldest first (existing files only)."""
    d = Path(directory)
    present = _present(d)
    try:
        lines = (d / LOG).read_text().splitlines()
    except FileNotFoundError:
        return present  # written before the log: one trajectory in step order
    names: list[str] = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        if event.get("event") == "commit" and event.get("file"):
            names = [n for n in names if n != event["file"]] + [event["file"]]
        elif event.get("event") == "start":
            start = event.get("from")
            names = (names[:names.index(start) + 1] if start in names
                     else [start] if start else [])
    return [n for n in names if n in present] or present  # none logged: as without a log


def append(directory, event: dict) -> None:
    """Append one event to the log, durably; a directory without a log gets its existing
    checkpoints recorded first, as one trajectory in step order."""
    d = Path(directory)
    log = d / LOG
    lines = [] if log.exists() else [{"event": "commit", "file": n, "seeded": True}
                                      for n in _present(d)]
    lines.append({**event, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    with open(log, "a") as fh:
        fh.write("".join(json.dumps(e) + "\n" for e in lines))
        fh.flush()
        os.fsync(fh.fileno())


def aside_name(step: int) -> str:
    """The folder name under ``abandoned/`` for what a run starting at ``step`` sets aside."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-from-step-{step}"


def start(directory, resumed_from: str | None, folder: str) -> tuple[list[str], Path]:
    """A run starts in ``directory``, continuing the trajectory up to the file named
    ``resumed_from`` (None: resumed from elsewhere, or a fresh start): every other
    checkpoint there is moved into ``abandoned/<folder>/`` and the start is logged.
    ``latest`` then names the trajectory's newest file (or is removed when none is left).
    Returns (the names moved, the folder). Nothing happens in a directory that does not
    exist."""
    d = Path(directory)
    target = d / ASIDE / folder
    if not d.is_dir():
        return [], target
    current = trajectory(d)
    keep = (current[:current.index(resumed_from) + 1] if resumed_from in current
            else [resumed_from] if resumed_from in _present(d) else [])
    moved = [n for n in _present(d) if n not in keep]
    if moved:
        n = 1
        while target.exists():  # never into a folder that holds files already
            n += 1
            target = d / ASIDE / f"{folder}-{n}"
        target.mkdir(parents=True)
        for name in moved:
            os.replace(d / name, target / name)
        fsync_dir(target)
        fsync_dir(d)
    if moved and keep:
        write_durably(d / LATEST, keep[-1] + "\n")
    elif moved:
        (d / LATEST).unlink(missing_ok=True)
    append(d, {"event": "start", "from": resumed_from, "set_aside": moved,
               "to": str(target.relative_to(d)) if moved else None})
    return moved, target

