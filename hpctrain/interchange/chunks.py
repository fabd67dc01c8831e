"""Whether the chunks a DCP ``.metadata`` lists for a tensor cover it: each chunk inside the
tensor, every element in exactly one chunk. A tensor saved by thousands of ranks has
thousands of chunks, so chunks are never compared all pairwise. Each dimension is cut at the
chunk edges on it (a grid whose cells no chunk edge crosses) and a d-dimensional difference
array counts the chunks holding each cell: O(chunks x 2^d + cells). Writers' layouts (each
rank a block of a process grid) give about one cell per chunk. A layout whose grid would pass
:data:`CELLS` cells is swept along its first dimension instead, each chunk compared with the
chunks holding the same rows (for a matrix only its two neighbours by column), and its gaps
found by counting the elements held.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import numpy as np

CELLS = 1 << 22  # the grid's budget: 16 MiB of int32 counts


def cover_problem(shape: tuple[int, ...], chunks: list[tuple[tuple, tuple]]) -> str | None:
    """What is wrong with ``chunks`` ((offsets, sizes) each) as a cover of a tensor of
    ``shape``, or None when they hold every element exactly once."""
    d = len(shape)
    odd = next(((o, s) for o, s in chunks if len(o) != d or len(s) != d), None)
    if odd is not None:
        return f"the chunk at offsets {tuple(odd[0])} of sizes {tuple(odd[1])} has not {d} " \
               f"dimensions"
    lo = np.array([o for o, _ in chunks], dtype=np.int64).reshape(len(chunks), d)
    size = np.array([s for _, s in chunks], dtype=np.int64).reshape(len(chunks), d)
    hi = lo + size
    out = np.flatnonzero(((lo < 0) | (size < 0) | (hi > np.array(shape, np.int64))).any(1))
    if len(out):
        o, s = chunks[out[0]]
        return (f"the chunk at offsets {tuple(o)} of sizes {tuple(s)} lies outside the "
                f"tensor ({_region(o, s)} is not inside {list(shape)})")
    held = (size > 0).all(1)  # an empty chunk holds nothing
    boxes = [(tuple(o), tuple(s)) for (o, s), h in zip(chunks, held) if h]
    lo, hi = lo[held], hi[held]
    if 0 in shape:
        return None
    if d == 0:
        return None if len(boxes) == 1 else f"its one element is in {len(boxes)} chunks"
    if not boxes:
        return "no chunk holds any of it"
    edges = [np.unique(np.concatenate(([0, n], lo[:, i], hi[:, i]))) for i, n in enumerate(shape)]
    if d == 1 or math.prod(len(e) for e in edges) <= CELLS:
        return _grid_problem(boxes, lo, hi, edges)
    return _sweep_problem(shape, boxes, lo, hi)


def _grid_problem(boxes, lo, hi, edges) -> str | None:
    """Count the chunks of each grid cell: +1/-1 at a chunk's 2^d corners, then a prefix sum
    along each axis."""
    d = len(edges)
    first = [np.searchsorted(e, lo[:, i]) for i, e in enumerate(edges)]
    past = [np.searchsorted(e, hi[:, i]) for i, e in enumerate(edges)]
    counts = np.zeros([len(e) for e in edges], dtype=np.int32)
    for corner in itertools.product((0, 1), repeat=d):
        at = tuple(past[i] if c else first[i] for i, c in enumerate(corner))
        np.add.at(counts, at, -1 if sum(corner) % 2 else 1)
    for axis in range(d):
        np.cumsum(counts, axis=axis, out=counts)
    counts = counts[tuple(slice(0, len(e) - 1) for e in edges)]
    bad = np.flatnonzero(counts != 1)
    if not len(bad):
        return None
    cell = np.unravel_index(bad[0], counts.shape)
    off = tuple(int(e[c]) for e, c in zip(edges, cell))
    size = tuple(int(e[c + 1] - e[c]) for e, c in zip(edges, cell))
    if counts[cell] == 0:
        return f"{_region(off, size)} is in no chunk (the metadata leaves a gap)"
    holders = [o for o, s in boxes if all(a <= x < a + n for x, a, n in zip(off, o, s))]
    return (f"{_region(off, size)} is in {len(holders)} chunks (at offsets "
            f"{', '.join(str(h) for h in holders[:3])}): chunks overlap")


def _sweep_problem(shape, boxes, lo, hi) -> str | None:
    """Overlaps among the chunks holding the same rows (a sweep along dimension 0), then gaps
    by the count of elements held. The chunks holding the current row are disjoint in the
    other dimensions; for a matrix they are kept sorted by first column, so a new chunk can
    only overlap its two neighbours there."""
    matrix = len(shape) == 2
    lo, hi = lo.tolist(), hi.tolist()  # Python ints: faster one by one than numpy's
    ending: list = []  # (end row, chunk) of the chunks holding the current row
    columns: list = []  # matrix: (first column, chunk) of the same chunks, sorted
    for j in sorted(range(len(lo)), key=lambda j: lo[j][0]):
        while ending and ending[0][0] <= lo[j][0]:
            _, k = heapq.heappop(ending)
            if matrix:
                del columns[bisect.bisect_left(columns, (lo[k][1], k))]
        if matrix:
            at = bisect.bisect_left(columns, (lo[j][1], j))
            near = [columns[i][1] for i in (at - 1, at) if 0 <= i < len(columns)]
        else:
            near = [k for _, k in ending]
        for k in near:
            if all(a < b and c < e for a, b, c, e in zip(lo[j][1:], hi[k][1:], lo[k][1:],
                                                          hi[j][1:])):
                start = [max(a, b) for a, b in zip(lo[j], lo[k])]
                stop = [min(a, b) for a, b in zip(hi[j], hi[k])]
                return (f"{_region(start, [b - a for a, b in zip(start, stop)])} is in the "
                        f"chunks at offsets {boxes[k][0]} and {boxes[j][0]}: chunks overlap")
        heapq.heappush(ending, (hi[j][0], j))
        if matrix:
            bisect.insort(columns, (lo[j][1], j))
    held, total = sum(math.prod(s) for _, s in boxes), math.prod(shape)
    return None if held == total else f"{total - held} of its {total} elements are in no chunk"


def _region(off, size) -> str:
    """``[a:b, c:d]`` (rows a to b-1), in the tensor's indices."""
    if not len(off):
        return "[]"
    spans = ", ".join(f"{int(o)}:{int(o) + int(s)}" for o, s in zip(off, size))
    return f"[{spans}] (rows {int(off[0])} to {int(off[0]) + int(size[0]) - 1})"
