"""What gradient reductions carry on the wire (``optim.grad_comm_dtype``): the gradients' own
dtype (``""``), or bfloat16 (half the bytes of float32). Only the transfer is 16-bit: a
bucket is accumulated in its float32 buffer, converted just before its collective
(rounded to nearest), summed as bfloat16 words (``comm``'s ``sum16``) and converted back
into the float32 buffer or shard the optimizer reads."""

from __future__ import annotations

import torch

DTYPES = {"": None, "bfloat16": torch.bfloat16}


def wire_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``optim.grad_comm_dtype`` (None: the gradients' own)."""
    return DTYPES[name]


def op_for(t: torch.Tensor, wire: torch.dtype | None) -> tuple:
    """The op argument of a collective about to send ``t``: ``("sum16",)`` for a wire copy,
    none (the collective's own sum) otherwise."""
    return ("sum16",) if wire is not None and t.dtype == wire else ()


def outgoing(t: torch.Tensor, group, wire: torch.dtype | None) -> torch.Tensor:
    """What to hand the collective over ``group``: ``t`` itself, or its wire copy (only
    where there is someone to send it to)."""
    return t if wire is None or group.size == 1 else t.to(wire)


def carried(group, flat: torch.Tensor, wire: torch.dtype | None, reduce) -> None:
    """``reduce(tensor[, op])`` summing ``flat`` in place over ``group``, on its wire copy
    (op ``sum16``) when ``wire`` is set, then copied back into ``flat``."""
    sent = outgoing(flat, group, wire)
    reduce(sent, *op_for(sent, wire))
    if sent is not flat:
        flat.copy_(sent)
