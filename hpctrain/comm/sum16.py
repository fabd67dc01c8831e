"""Sums carried in 16 bits: the MPI reduction op ``sum16`` over bfloat16 words.

MPI has no bfloat16 type, so ``Group`` normally reduces 16-bit tensors staged in float32
(32 bits on the wire). ``op="sum16"`` instead hands MPI the 16-bit words themselves and this
user-defined, commutative op adds two of them: both widened to float32, added, rounded to
the nearest bfloat16 (torch's conversion: ties to even). Each partial sum of a collective is
rounded once, so a sum over n ranks carries up to n - 1 roundings of bfloat16's 8-bit
mantissa; the exponent range is float32's (no overflow a float32 sum would not have).
"""

from __future__ import annotations

import warnings

from mpi4py import MPI

BLOCK = 1 << 15  # elements per pass: the widened block stays in cache (32768: 128 KiB)
_scratch: list = []  # one float32 block, made on first use
_op: list = []  # the MPI op, made on first use: importing hpctrain needs no MPI_Init


def add_bf16(inbuf, inoutbuf, _datatype=None) -> None:
    """``inoutbuf += inbuf``, both bfloat16 words (the op's body; MPI calls it on pieces):
    block by block, each widened to float32 in one cached buffer, added, rounded back.
    Numerically the same as widening whole; 3-6x faster on pieces of millions of words."""
    import torch  # loaded already: only tensors are reduced with sum16

    if not len(inoutbuf):
        return
    with warnings.catch_warnings():  # inbuf is read-only; it is only read
        warnings.simplefilter("ignore", UserWarning)
        a = torch.frombuffer(inbuf, dtype=torch.bfloat16)
    b = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
    if not _scratch:
        _scratch.append(torch.empty(BLOCK, dtype=torch.float32))
    for lo in range(0, b.numel(), BLOCK):
        hi = min(b.numel(), lo + BLOCK)
        s = _scratch[0][:hi - lo]
        s.copy_(a[lo:hi]).add_(b[lo:hi])
        b[lo:hi].copy_(s)


def op() -> MPI.Op:
    """The MPI op that sums bfloat16 words with :func:`add_bf16` (made once, on first use)."""
    if not _op:
        _op.append(MPI.Op.Create(add_bf16, commute=True))
    return _op[0]
