"""Which tokens each step trains on: every sample once per epoch, the same on every layout.

Samples (Megatron's GPT dataset semantics): the split's ``N`` tokens, documents packed
across their boundaries, are cut into ``n = (N - 1) // T`` fixed windows of ``T + 1`` tokens
(``T = seq_len``): sample ``k`` is ``tokens[k*T : k*T + T + 1]``, so consecutive samples
share one token (the last target of one is the first input of the next) and a tail of fewer
than ``T`` tokens is left out. Global sample ``g = step * G + i`` (``G`` the global batch) is
sample ``order(epoch)[g % n]`` of epoch ``g // n``, where ``order(epoch)`` is a permutation
of ``range(n)`` drawn from ``(seed, epoch)`` (:class:`EpochOrder`). A step's batch is
therefore a function of ``(seed, step, N, T, G)`` alone: identical on every layout, and a
run resumed at step ``s`` on any layout continues the same stream.

Global microbatch ``j`` is sequences ``[j*dp*mbs, (j+1)*dp*mbs)`` of the global batch; dp
rank ``r`` takes ``mbs`` consecutive sequences of it. With context parallelism every cp rank
of a dp rank takes the same sequences and keeps its own positions of them
(:func:`context_positions`: chunks ``i`` and ``2cp-1-i`` of ``2cp``). Each rank reads only
its own windows (``tokens`` may be a lazy :class:`~.dataset.TokenFile`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

ROUNDS = 4  # Feistel rounds of EpochOrder
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


class EpochOrder:
    """A pseudo-random permutation of ``range(n)`` keyed by ``(seed, epoch)``, evaluated at
    any positions without building it: a balanced Feistel network on the smallest ``2h``-bit
    domain holding ``n``, walked again from any value that falls outside ``range(n)`` (cycle
    walking keeps it a bijection on ``range(n)``). Memory and time do not grow with ``n``;
    round keys come from ``np.random.default_rng([seed, epoch])`` (``[seed, stream, epoch]``
    for the ``stream``-th source of a blend)."""

    def __init__(self, n: int, seed: int, epoch: int, stream: int | None = None):
        if n < 1:
            raise ValueError(f"an epoch needs at least one sample, got n={n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        rng = np.random.default_rng([seed, epoch] if stream is None else [seed, stream, epoch])
        self.keys = rng.integers(0, 2**63, size=ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            f = (right ^ k) * _M1
            f ^= f >> np.uint64(31)
            f *= _M2
            f ^= f >> np.uint64(29)
            left, right = right, left ^ (f & self.mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (each in ``range(n)``) of this epoch's order."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        out = np.ones(x.shape, dtype=bool)
        while out.any():
            x[out] = self._round_trip(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


def samples_per_epoch(tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens in a split of ``tokens`` tokens (sharing one)."""
    return max(0, (tokens - 1) // seq_len)


def epochs_covered(tokens: int, seq_len: int, global_batch: int, steps: int) -> float:
    """How many epochs of a split ``steps`` steps of ``global_batch`` samples cover."""
    n = samples_per_epoch(tokens, seq_len)
    return steps * global_batch / n if n else float("inf")


def context_positions(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """The positions of a sequence that cp rank ``cp_rank`` holds: chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks (causal load balancing: every
    rank gets one early and one late chunk, so the same attention work), in increasing
    order. All positions when ``cp_size`` is 1. Matches ``parallel.ring_attention.segments``."""
    if cp_size == 1:
        return np.arange(seq_len)
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return np.concatenate([np.arange(cp_rank * c, (cp_rank + 1) * c),
                           np.arange(late * c, (late + 1) * c)])


def windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """(len(starts), length) int64: ``tokens[s : s + length]`` for each start; ``tokens`` is
    an array or anything with a ``windows`` method (a lazily read file)."""
    if hasattr(tokens, "windows"):
        return tokens.windows(starts, length)
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)[None, :]
    return np.asarray(tokens)[idx].astype(np.int64)


class Sampler:
    """Deterministic, layout-independent batches, every sample once per epoch.

    ``global_batch(step)`` -> (x, y) int64 tensors of shape (G, T); ``local(step)`` -> the
    list of this dp rank's microbatches [(x_j, y_j)], each (mbs, T), or with context
    parallelism (mbs, T/cp): this cp rank's positions (:func:`context_positions`).
    ``local`` is ``place(host(step), step)``: :meth:`host` reads this rank's windows (no
    torch device, no MPI: safe in a read-ahead thread), :meth:`place` makes tensors on the
    device. With ``documents`` (``data.segments.Documents``) each microbatch is
    (x_j, y_j, d_j): d_j its windows' document ids and positions, (mbs, 2, T) (all T, with cp
    too). With ``ahead = D > 0`` (multi-token prediction) y_j is (mbs, 1 + D, T[/cp]): row
    ``j`` holds the token ``j + 1`` after each input position, -1 past the window's end.
    """

    def __init__(self, tokens, seq_len: int, global_batch: int, micro_batch: int,
                 dp_size: int, dp_rank: int, seed: int, device=None, cp_size: int = 1,
                 cp_rank: int = 0, documents=None, stream: int | None = None,
                 ahead: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len+2 = "
                             f"{seq_len + 2}")
        self.tokens, self.T, self.G = tokens, seq_len, global_batch
        self.mbs, self.dp, self.r, self.seed = micro_batch, dp_size, dp_rank, seed
        self.n = samples_per_epoch(len(tokens), seq_len)
        self.microbatches = global_batch // (dp_size * micro_batch)
        self.device = device  # batches are moved there (the GPU of this rank)
        self.columns = None if cp_size == 1 else context_positions(seq_len, cp_size, cp_rank)
        self._orders: dict[int, EpochOrder] = {}
        self.documents = documents  # window starts -> (B, 2, T) ids and positions, or None
        self.stream = stream  # a blend's source index: keys its EpochOrder (data/blend.py)
        self.ahead = ahead  # targets beyond the next token (multi-token prediction)

    def epoch_sizes(self) -> list[int]:
        """Samples per epoch of each source (one here; a blend's: one per source)."""
        return [self.n]

    def order(self, epoch: int) -> EpochOrder:
        if epoch not in self._orders:
            if len(self._orders) >= 4:  # a step spans few epochs; the oldest goes
                del self._orders[next(iter(self._orders))]
            self._orders[epoch] = EpochOrder(self.n, self.seed, epoch, self.stream)
        return self._orders[epoch]

    def samples(self, step: int) -> np.ndarray:
        """(G,) the sample index of each sequence of step ``step``'s global batch."""
        return self.samples_at(step * self.G + np.arange(self.G, dtype=np.int64))

    def samples_at(self, g: np.ndarray) -> np.ndarray:
        """The sample at each position ``g`` of the stream (epoch ``g // n``)."""
        epoch, pos = g // self.n, g % self.n
        out = np.empty(len(g), dtype=np.int64)
        for e in np.unique(epoch):
            here = epoch == e
            out[here] = self.order(int(e))(pos[here])
        return out

    def starts(self, step: int) -> np.ndarray:
        """(G,) the global token offset of each of step ``step``'s windows of ``T + 1``
        tokens, in global-batch order."""
        return self.samples(step) * self.T

    def position(self, steps_done: int) -> dict:
        """Where the stream stands after ``steps_done`` steps: ``epoch`` (counted from 0)
        and ``epoch_position`` (samples of that epoch already trained on)."""
        done = steps_done * self.G
        return {"epoch": done // self.n, "epoch_position": done % self.n}

    def _local_starts(self, step: int) -> list[np.ndarray]:
        starts = self.starts(step)
        return [starts[j * self.dp * self.mbs + self.r * self.mbs:][:self.mbs]
                for j in range(self.microbatches)]

    def host(self, step: int) -> list[np.ndarray]:
        """This rank's microbatches of step ``step`` as (mbs, T + 1) int64 arrays."""
        return [windows(self.tokens, s, self.T + 1) for s in self._local_starts(step)]

    def place(self, rows: list[np.ndarray], step: int) -> list[tuple[torch.Tensor, ...]]:
        """Step ``step``'s microbatches read by :meth:`host` as tensors on the device."""
        out = [self._split(r, self.columns) for r in rows]
        if self.documents is not None:
            for j, s in enumerate(self._local_starts(step)):
                d = self.documents(s)
                out[j] += (d if self.device is None else d.to(self.device),)
        return out

    def _split(self, rows: np.ndarray, columns=None) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # not at module level: `hpctrain prepare` runs without it

        seq = torch.from_numpy(rows)
        if self.ahead:
            return self._split_ahead(seq, columns)
        if columns is not None:  # this cp rank's positions (inputs, then their targets)
            cols = torch.from_numpy(np.concatenate([columns, columns + 1]))
            seq = seq[:, cols]
        if self.device is not None:
            seq = seq.to(self.device)
        if columns is None:
            return seq[:, :-1], seq[:, 1:]
        return seq[:, :len(columns)], seq[:, len(columns):]

    def _split_ahead(self, seq, columns=None):
        """(x (B, n), y (B, 1 + ahead, n)) of windows ``seq`` (B, T + 1) at ``columns`` (n of
        them; None: all T): y[:, j] the tokens ``j + 1`` after, -1 past the window."""
        import torch

        cols = np.arange(self.T) if columns is None else np.asarray(columns)
        idx = np.concatenate([cols + j for j in range(self.ahead + 2)])
        picked = seq[:, torch.from_numpy(np.minimum(idx, self.T))]
        picked[:, torch.from_numpy(idx > self.T)] = -1
        if self.device is not None:
            picked = picked.to(self.device)
        n = len(cols)
        return picked[:, :n], picked[:, n:].reshape(len(seq), self.ahead + 1, n)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._split(windows(self.tokens, self.starts(step), self.T + 1))

    def local(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        return self.place(self.host(step), step)


class ReadAhead:
    """``get(step)`` returns ``sampler.local(step)``; when ``enabled``, a worker thread reads
    step ``step + 1``'s windows while the caller computes step ``step``. The thread only
    reads (no MPI, no device); its exception is raised by the ``get`` that needs its result.
    A ``get`` for another step than the one read ahead reads in the caller."""

    def __init__(self, sampler: Sampler, enabled: bool = True):
        self.sampler = sampler
        self.pool = ThreadPoolExecutor(1, "hpctrain-data") if enabled else None
        self.pending: tuple[int, object] | None = None

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ahead, self.pending = self.pending, None
        if ahead is not None and ahead[0] == step:
            rows = ahead[1].result()
        else:
            if ahead is not None and not ahead[1].cancel():
                ahead[1].exception()  # wait: one reader at a time; its error is not ours
            rows = self.sampler.host(step)
        if self.pool is not None:
            self.pending = (step + 1, self.pool.submit(self.sampler.host, step + 1))
        return self.sampler.place(rows, step)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = self.pending = None
