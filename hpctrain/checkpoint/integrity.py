"""Checkpoint integrity and lineage, without MPI (used by ranks, ``inspect`` and tests).

**Checksum.** Every dataset carries ``attrs["crc32"]``: zlib's CRC-32 of the *global* array's
bytes in C order (little-endian, the file dtype). Writers compute it from the bytes in memory
as they hand them to HDF5: each rank CRCs the contiguous runs of its hyperslabs
(:func:`segments`), and the runs of all ranks are joined in global order with
:func:`crc32_combine` (zlib's algorithm: CRC(A+B) from CRC(A), CRC(B) and len(B)), so no
byte is read back and the number does not depend on how ranks cut the array: any layout, and
any single process reading the file (``hpctrain inspect --verify``, :func:`crc32_dataset`),
gets the same number. The file's ``checksum`` attribute names the scheme. Datasets are
created without fill (``fill_time="never"``), so the writer first checks that the ranks'
runs tile every dataset exactly (write.py); only then does a checksum certify the contents.

**Durability.** :func:`fsync_file`, :func:`replace_durably` and :func:`write_durably`: data
synced before a rename, the directory synced after it. :class:`Writeback` starts the disk
writing while the writer still copies (Linux ``sync_file_range``), so the fsync that makes
a checkpoint durable finds little left to do.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np

FORMAT = "hpctrain-ckpt-1"
CHECKSUM = "crc32 of the global array, C order, little-endian"
BLOCK_BYTES = 16 << 20  # read back in blocks of about 16 MiB


def disable_file_locking() -> None:
    """HDF5 >= 1.10.7 takes POSIX locks on open; many parallel file systems (Lustre without
    ``flock``, NFS) fail or hang on them. hpctrain never relies on them: readers only open
    committed (renamed) files. A value set by the user is respected."""
    os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")


def crc32_dataset(dset) -> int:
    """CRC-32 of one h5py dataset's global array (C order, little-endian)."""
    crc = 0
    if dset.shape == ():
        return zlib.crc32(np.ascontiguousarray(dset[()]).astype(dset.dtype.newbyteorder("<"))
                          .tobytes())
    rows = dset.shape[0]
    row_bytes = max(1, dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64)))
    step = max(1, BLOCK_BYTES // row_bytes)
    for r in range(0, rows, step):
        block = np.ascontiguousarray(dset[r:r + step], dtype=dset.dtype.newbyteorder("<"))
        crc = zlib.crc32(block.reshape(-1).view(np.uint8), crc)  # no copy of the bytes
    return crc


_POLY = 0xEDB88320  # CRC-32 (zlib), reflected
_X2N = [1 << 30] + [0] * 31  # x^(2^k) mod P, k = 0..31 (reflected: bit 31 is x^0)


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) mod P(x) over GF(2), reflected bit order (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


for _k in range(1, 32):
    _X2N[_k] = _multmodp(_X2N[_k - 1], _X2N[_k - 1])


@functools.lru_cache(maxsize=4096)
def _x8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P: the operator that appends ``nbytes`` zero bytes."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = CRC(A), crc2 = CRC(B) and len2 = len(B) in bytes."""
    return _multmodp(_x8n(len2), crc1) ^ crc2 if len2 else crc1


def segments(buf, runs) -> list[tuple[int, int, int]]:
    """``[(byte offset, nbytes, crc32)]`` of a 1-D array ``buf`` that holds ``runs`` ``[(flat
    element offset in the global array, elements)]`` one after another (layout.py)."""
    raw = memoryview(np.ascontiguousarray(buf, dtype=buf.dtype.newbyteorder("<"))).cast("B")
    size, pos, out = buf.dtype.itemsize, 0, []
    for offset, n in runs:
        nb = n * size
        out.append((offset * size, nb, zlib.crc32(raw[pos:pos + nb])))
        pos += nb
    return out


def join_segments(segs, nbytes: int) -> tuple[int | None, str]:
    """(CRC-32 of the whole array, "") from every rank's segments, or (None, why) when they
    do not tile ``[0, nbytes)`` exactly (a gap or an overlap)."""
    crc, pos = 0, 0
    for offset, n, c in sorted(segs):
        if offset != pos:
            what = "a gap" if offset > pos else "an overlap"
            return None, f"{what} at byte {min(offset, pos)}"
        crc, pos = crc32_combine(crc, c, n), pos + n
    if pos != nbytes:
        return None, f"{pos} of {nbytes} bytes written"
    return crc, ""


def fsync_file(path) -> None:
    """Force ``path``'s data to stable storage. On a parallel file system each client caches
    its own writes: every process that wrote part of the file calls this."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writeback:
    """Starts the writing of a file's dirty pages to disk every ``every`` bytes written
    through ``fd`` (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it does not wait), so the
    copies into the page cache and the disk's writing overlap, as databases do
    (PostgreSQL's ``checkpoint_flush_after``). Only this writer's own spans (adjacent writes
    joined): another rank's pages in between are left to it. Does nothing where the call is
    missing."""

    def __init__(self, fd: int, every: int):
        self.fd, self.every, self.spans, self.pending = fd, every, [], 0

    def wrote(self, at: int, nbytes: int) -> None:
        if self.spans and self.spans[-1][1] == at:
            self.spans[-1][1] = at + nbytes
        else:
            self.spans.append([at, at + nbytes])
        self.pending += nbytes
        if self.pending >= self.every:
            for lo, hi in self.spans:
                _sync_file_range(self.fd, lo, hi - lo)
            self.spans, self.pending = [], 0


@functools.cache
def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


def _sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    fn = _libc_sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure leaves it to fsync


def fsync_dir(directory) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fsync_file(directory)


def replace_durably(src, dst) -> None:
    """Rename ``src`` (its data already fsynced) over ``dst``; the rename itself is made
    durable by syncing the directory."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def write_durably(path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably: ``.NAME.tmp`` written and fsynced,
    renamed over ``path``, the directory synced."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    replace_durably(tmp, path)


def dataset_names(f) -> list[str]:
    """Every dataset's path in a file, sorted (the order all ranks agree on)."""
    names = []
    f.visititems(lambda n, o: names.append(n) if hasattr(o, "shape") else None)
    return sorted(names)


def compute_checksums(path, names) -> dict[str, int]:
    """{name: crc32} for ``names``, reading ``path`` read-only (any process)."""
    import h5py

    disable_file_locking()
    with h5py.File(path, "r") as f:
        return {n: crc32_dataset(f[n]) for n in names}


def stamp(path, sums: dict[str, int]) -> None:
    """Write the checksums into a closed (not yet committed) file. One process only."""
    import h5py

    with h5py.File(path, "r+") as f:
        for name, crc in sums.items():
            f[name].attrs["crc32"] = np.uint32(crc)
        f.attrs["checksum"] = CHECKSUM


def verify(path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems found in ``path`` (empty: sound). Checks that the file opens, is an
    hpctrain checkpoint, and that every dataset in this process's ``share = (index, count)``
    of the sorted dataset list matches its stored CRC-32. Never raises."""
    import h5py

    disable_file_locking()
    problems = []
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                return [f"{path}: not an hpctrain checkpoint (format attribute missing)"]
            names = dataset_names(f)
            for name in names[share[0]::share[1]]:
                try:
                    stored = f[name].attrs.get("crc32")
                    if stored is None:
                        problems.append(f"{name}: no checksum")
                    elif int(stored) != crc32_dataset(f[name]):
                        problems.append(f"{name}: checksum mismatch")
                except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
                    problems.append(f"{name}: unreadable ({e})")
    except Exception as e:  # noqa: BLE001
        problems.append(f"{path}: cannot open ({e})")
    return problems


def describe(path) -> dict:
    """Attributes and datasets of a checkpoint, as plain JSON-able data."""
    import h5py

    disable_file_locking()
    with h5py.File(path, "r") as f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        tensors = [{"name": n, "shape": list(f[n].shape), "dtype": str(f[n].dtype),
                    "nbytes": int(f[n].size * f[n].dtype.itemsize),
                    "offset": f[n].id.get_offset(),  # None: not contiguous or not allocated
                    "crc32": _plain(f[n].attrs.get("crc32"))} for n in dataset_names(f)]
    return {"path": str(path), "attrs": attrs, "tensors": tensors}


def _plain(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def versions() -> str:
    """Package versions that made the checkpoint, as JSON."""
    import h5py
    import mpi4py
    import torch

    from .. import __version__

    return json.dumps({"hpctrain": __version__, "python": sys.version.split()[0],
                       "torch": torch.__version__, "numpy": np.__version__,
                       "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
                       "mpi4py": mpi4py.__version__})


def git_commit() -> str:
    """The commit of the code that runs: the git checkout whose tracked files hold this
    package (``+dirty`` when a tracked file is modified), found from the package's own
    directory whatever the working directory; else the commit pip recorded when it installed
    the package from a repository (``direct_url.json``); else "unknown"."""
    package = Path(__file__).resolve().parents[1]
    return _checkout_commit(package) or _installed_commit(package) or "unknown"


def _checkout_commit(package: Path) -> str:
    """HEAD of the checkout that tracks ``package`` ("" when none does or git is missing)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(package), *args], text=True,
                              capture_output=True, timeout=10)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return ""
        head = git("rev-parse", "HEAD").stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def _installed_commit(package: Path) -> str:
    """The ``vcs_info.commit_id`` of the installed distribution that is ``package`` ("")."""
    from importlib import metadata

    try:
        dist = metadata.distribution("hpctrain")
        if Path(str(dist.locate_file("hpctrain"))).resolve() != package:
            return ""
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, OSError, ValueError):
        return ""
    commit = info.get("vcs_info", {}).get("commit_id", "") if isinstance(info, dict) else ""
    return str(commit)
