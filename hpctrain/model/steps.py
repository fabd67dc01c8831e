"""A stage's forward as a generator: the one forward pass, and the points where it can pause.

``DecoderStage.steps`` / ``Block.steps`` / ``MoE.steps`` are generators. They *yield requests*
to whoever drives them and *return* the result. Three kinds of request:

- :class:`RunBlock` (from a stage, for each block): :func:`drive` answers ``block(x)`` (an
  ordinary module call: hooks fire, an MoE block runs with blocking exchanges inside); the
  MoE-overlap executor steps into ``block.steps(x)`` instead.
- :class:`RunExperts` (from a block, before its MoE feed-forward): the residual ``h`` and the
  expert input ``xs``; the answer is ``(h, experts' output)``. ``drive`` calls the layer;
  the overlap executor may first cut the graph (``h`` and ``xs`` as fresh leaves, for its
  segmented backward) and steps into ``layer.steps(xs)``.
- :class:`Exchange` (from an MoE layer): rows leave for the expert all-to-all; the answer is
  the rows received. ``drive`` uses the layer's blocking exchange; the overlap executor posts
  it nonblocking and computes another microbatch meanwhile.

So a block is written once, and the plain forward (:func:`drive`) and the overlap executor
run the same code.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class RunBlock(NamedTuple):
    block: Any  # a Block module
    x: Any  # its input (B, T, C), or (B, T/tp, C) with sequence parallelism
    doc: Any = None  # document ids and positions (B, 2, T) (data.document_mask), or None

    def call(self):
        """The block as an ordinary module call (hooks fire)."""
        return self.block(self.x) if self.doc is None else self.block(self.x, self.doc)


class RunExperts(NamedTuple):
    layer: Any  # the MoE module about to run
    h: Any  # (B, T, C) residual stream after attention
    xs: Any  # (B, T, C) normalised input of the experts


class Exchange(NamedTuple):
    layer: Any  # the MoE module (its ``exchange`` moves the rows)
    kind: str  # "dispatch" or "combine"
    rows: Any  # (m, C) rows grouped by destination peer
    send_rows: Any  # rows to each peer
    recv_rows: Any  # rows from each peer


def answer(gen, respond):
    """Generator: run ``gen``, sending back what ``respond(request)`` returns for each of its
    requests, and return ``gen``'s result. ``respond`` is a generator function: it may step
    into further generators or pass a request further up (``yield``)."""
    value = None
    while True:
        try:
            req = gen.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield from respond(req)


def drive(gen):
    """Run a stepped forward with module calls and blocking exchanges; return its result."""
    run = answer(gen, _blocking)
    try:
        next(run)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a blocking forward passed a request up")  # _blocking never yields


def _blocking(req):
    """The plain answer to a request: a module call, the layer, the blocking exchange."""
    if isinstance(req, RunBlock):
        return req.call()
    if isinstance(req, RunExperts):
        return (req.h, req.layer(req.xs))
    ex = req.layer.exchange
    move = ex.dispatch if req.kind == "dispatch" else ex.combine
    return move(req.rows, req.send_rows, req.recv_rows)
    yield  # a generator function that never pauses (see answer)
