"""Sums carried in 16 bits: the MPI reduction op ``sum16`` over bfloat16 words.

MPI has no bfloat16 type, so ``Group`` normally reduces 16-bit tensors staged in float32
(32 bits on the wire). ``op="sum16"`` instead hands MPI the 16-bit words themselves and this
user-defined, commutative op adds two of them: both widened to float32 (a bfloat16 is the
upper half of a float32), added, rounded to the nearest bfloat16 (ties to even). Each partial
sum of a collective is rounded once, so a sum over n ranks carries about n roundings of
bfloat16's 8-bit mantissa; the exponent range is float32's (no overflow a float32 sum would
not have).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def widen(words: np.ndarray) -> np.ndarray:
    """bfloat16 words (uint16) -> float32 values."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 words (uint16), rounded to nearest, ties to even; NaN
    stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def _add_bf16(inbuf, inoutbuf, _datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    b[:] = narrow(widen(a) + widen(b))


SUM16 = MPI.Op.Create(_add_bf16, commute=True)
