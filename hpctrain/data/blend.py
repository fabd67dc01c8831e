"""Blending corpora (``data.sources``): which source each global sample comes from, and the
sampler that reads a step's windows from several prepared files.

**The order.** Weights are made integers ``W_i`` in their exact proportions
(:func:`integer_weights`: each weight as written, 0.7 as 7/10, reduced by the gcd; 0.7 and 0.3
become 7 and 3, 1 and 1e-5 become 100000 and 1) with total ``P`` (at most
:data:`MAX_PERIOD`: finer proportions are refused, never rounded).
Samples are handed out one after another by a deadline rule (Tijdeman's solution of the
chairman assignment problem): with ``c_i`` samples of source ``i`` among the first ``N - 1``,
sample ``N`` may go to source ``i`` once ``N W_i / P >= c_i + 1/D`` (``D = 2k - 2`` for ``k``
sources), and goes to the eligible source whose next deadline ``(c_i + 1 - 1/D) P / W_i``
comes first (ties: the lowest index). Every prefix of the stream then holds each source
within ``1 - 1/D < 1`` sample of its share ``N W_i / P``, the best bound possible; the state
is the deficits alone, which are all zero again after ``P`` samples, so the order repeats with
period ``P`` and sample ``g``'s source and its index among that source's samples are a
table look-up (:class:`BlendOrder`): stateless in the step, as a resume on any layout needs.

**The samples.** Source ``i``'s ``c``-th sample is its own sample ``order_i(c // n_i)[c %
n_i]`` (``n_i`` its samples per epoch, ``order_i`` an ``EpochOrder`` keyed by ``(seed, i,
epoch)``): every source has its own epochs, each of its samples once per its epoch.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np

from .sampler import Sampler, windows

MAX_PERIOD = 1_000_000  # samples in one period of the order (its table: 8 bytes x sources each)


def integer_weights(weights) -> list[int]:
    """Positive integer weights in exactly the proportions of ``weights`` (a float read as
    written: ``repr``), reduced by their greatest common divisor; ValueError when their sum,
    the order's period, exceeds :data:`MAX_PERIOD`."""
    exact = [Fraction(repr(w)) if isinstance(w, float) else Fraction(w) for w in weights]
    scale = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * scale) for f in exact]
    g = math.gcd(*ints)
    ints = [w // g for w in ints]
    if sum(ints) > MAX_PERIOD:
        raise ValueError(
            f"data.sources weights {[float(w) for w in weights]}: their exact proportions "
            f"{':'.join(map(str, ints))} repeat only every {sum(ints):,} samples (the limit is "
            f"{MAX_PERIOD:,}); give weights whose ratio has fewer digits, e.g. rounded to "
            f"{1 / MAX_PERIOD * 10:g} of the total")
    return ints


def sequential(weights: list[int], count: int) -> list[int]:
    """The source of each of the first ``count`` samples, one after another (the rule
    itself; :class:`BlendOrder` tabulates one period of it)."""
    k, total = len(weights), sum(weights)
    d = max(1, 2 * k - 2)
    c = [0] * k
    out = []
    for n in range(1, count + 1):
        best = -1
        for i in range(k):
            if n * weights[i] * d < (c[i] * d + 1) * total and k > 1:
                continue  # not yet released
            if best < 0 or ((c[i] * d + d - 1) * weights[best]
                            < (c[best] * d + d - 1) * weights[i]):
                best = i
        c[best] += 1
        out.append(best)
    return out


class BlendOrder:
    """Which source global sample ``g`` comes from and its index among that source's
    samples, for any ``g``: one period of :func:`sequential` as a table."""

    def __init__(self, weights):
        self.weights = integer_weights(weights)
        self.period = sum(self.weights)
        self.source = np.asarray(sequential(self.weights, self.period), dtype=np.int64)
        k = len(self.weights)
        onehot = np.zeros((self.period + 1, k), dtype=np.int64)
        onehot[np.arange(1, self.period + 1), self.source] = 1
        self.prefix = np.cumsum(onehot, axis=0)  # (P + 1, k): counts among the first p

    def __call__(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index among that source's samples) of each global sample in ``g``."""
        g = np.asarray(g, dtype=np.int64)
        cycle, p = g // self.period, g % self.period
        src = self.source[p]
        w = np.asarray(self.weights, dtype=np.int64)
        return src, cycle * w[src] + self.prefix[p, src]

    def counts(self, n: int) -> np.ndarray:
        """(k,) samples of each source among the first ``n`` global samples."""
        cycle, p = divmod(int(n), self.period)
        return cycle * np.asarray(self.weights, dtype=np.int64) + self.prefix[p]


class BlendedSampler(Sampler):
    """The :class:`~.sampler.Sampler` of several sources: the same batch layout, microbatch
    slices, context-parallel positions and document masks, each window read from its own
    source (``parts``: one Sampler per source, ``stream`` = its index, which only orders that
    source's samples). ``documents`` of a part: that source's ``Documents``."""

    def __init__(self, parts: list[Sampler], weights, names=None):
        first = parts[0]
        self.parts, self.blend = parts, BlendOrder(weights)
        self.names = list(names or range(len(parts)))
        self.T, self.G, self.mbs, self.dp, self.r = first.T, first.G, first.mbs, first.dp, first.r
        self.seed, self.microbatches = first.seed, first.microbatches
        self.device, self.columns, self.ahead = first.device, first.columns, first.ahead
        self.n = sum(p.n for p in parts)
        self.documents = None

    def epoch_sizes(self) -> list[int]:
        return [p.n for p in self.parts]

    def picks(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(G,) source and (G,) sample of that source for each sequence of step ``step``."""
        g = step * self.G + np.arange(self.G, dtype=np.int64)
        src, c = self.blend(g)
        sample = np.empty(self.G, dtype=np.int64)
        for i in np.unique(src):
            here = src == i
            part = self.parts[int(i)]
            sample[here] = part.samples_at(c[here])
        return src, sample

    def position(self, steps_done: int) -> dict:
        """``blend_position``: JSON, per source its name, ``epoch`` and ``epoch_position``
        (as :meth:`Sampler.position`) after ``steps_done`` steps."""
        done = self.blend.counts(steps_done * self.G)
        return {"blend_position": json.dumps([
            {"source": str(name), "epoch": int(c // p.n), "epoch_position": int(c % p.n)}
            for name, p, c in zip(self.names, self.parts, done)])}

    def _local_picks(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        src, sample = self.picks(step)
        out = []
        for j in range(self.microbatches):
            lo = j * self.dp * self.mbs + self.r * self.mbs
            out.append((src[lo:lo + self.mbs], sample[lo:lo + self.mbs] * self.T))
        return out

    def _read(self, src: np.ndarray, starts: np.ndarray) -> np.ndarray:
        rows = np.empty((len(src), self.T + 1), dtype=np.int64)
        for i in np.unique(src):
            here = src == i
            rows[here] = windows(self.parts[int(i)].tokens, starts[here], self.T + 1)
        return rows

    def host(self, step: int) -> list[np.ndarray]:
        return [self._read(src, starts) for src, starts in self._local_picks(step)]

    def place(self, rows: list[np.ndarray], step: int) -> list[tuple]:
        out = [self._split(r, self.columns) for r in rows]
        if self.parts[0].documents is None:
            return out
        import torch

        for j, (src, starts) in enumerate(self._local_picks(step)):
            d = torch.empty((len(src), 2, self.T), dtype=torch.int64)
            for i in np.unique(src):
                here = np.flatnonzero(src == i)
                d[torch.from_numpy(here)] = self.parts[int(i)].documents(starts[here])
            out[j] += (d if self.device is None else d.to(self.device),)
        return out

    def global_batch(self, step: int):
        src, sample = self.picks(step)
        return self._split(self._read(src, sample * self.T))


def names(sources) -> list[str]:
    """A short name per source (``val_loss/NAME``): the file's stem, with ``-i`` appended
    where two stems are the same."""
    from pathlib import Path

    stems = [Path(s.path).stem for s in sources]
    return [f"{s}-{i}" if stems.count(s) > 1 else s for i, s in enumerate(stems)]


def blend_lineage(sources, lineages: list[dict]) -> dict:
    """The data lineage of a blend: the first source's tokenizer attributes, a content hash
    over every source's content hash and integer weight (so a changed blend is a changed
    stream; 0.7/0.3 and 7/3 are the same blend), and ``blend``: JSON, per source its path,
    content hash and weight."""
    from .dataset import content_hash

    ints = integer_weights([s.weight for s in sources])
    parts = [{"path": str(lin.get("source", s.path)), "content_hash": lin.get("content_hash", ""),
              "weight": s.weight} for s, lin in zip(sources, lineages)]
    key = ";".join(f"{p['content_hash']}:{w}" for p, w in zip(parts, ints))
    out = {k: v for k, v in lineages[0].items() if k.startswith(("tokenizer", "vocab"))}
    return {**out, "source": "blend of " + ", ".join(f"{p['path']} x{p['weight']:g}"
                                                     for p in parts),
            "content_hash": content_hash(np.frombuffer(key.encode(), np.uint8)),
            "blend": json.dumps(parts)}


def open_stream(d, split: str, seq_len: int, global_batch: int, micro_batch: int, dp_size: int,
                dp_rank: int, seed: int, device=None, cp_size: int = 1,
                cp_rank: int = 0, ahead: int = 0) -> tuple[Sampler, dict]:
    """The sampler of ``split`` of the run's data (``d``: the ``[data]`` section: one file,
    the embedded corpus, or a blend of ``d.sources``) and its lineage; ``ahead``: targets
    beyond the next token (``Sampler``). Every rank reads for itself; no collective."""
    from . import segments
    from .dataset import load_tokens

    args = (seq_len, global_batch, micro_batch, dp_size, dp_rank, seed)
    kw = {"device": device, "cp_size": cp_size, "cp_rank": cp_rank, "ahead": ahead}
    if not d.sources:
        data = load_tokens(d.path, split, d.corpus_mb, d.val_fraction, d.tokenizer)
        return Sampler(data.tokens, *args, **kw,
                       documents=segments.for_split(d, split, seq_len)), data.lineage
    parts, lineages = [], []
    for i, s in enumerate(d.sources):
        data = load_tokens(s.path, split)
        docs = (segments.Documents(segments.doc_starts(s.path, split), seq_len)
                if d.document_mask else None)
        parts.append(Sampler(data.tokens, *args, **kw, documents=docs, stream=i))
        lineages.append(data.lineage)
    return (BlendedSampler(parts, [s.weight for s in d.sources], names(d.sources)),
            blend_lineage(d.sources, lineages))
