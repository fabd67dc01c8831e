"""Benchmarks side by side: hpctrain against PyTorch's own distributed training, against the
naive baseline and against the limit, on the same model, init, data and batch.

Each comparison is one module (:func:`module` of its name) with ``RANKS`` (the world sizes
it runs at) and ``run(world, size, repeats) -> dict``, called on every rank of one
``mpirun`` (collective over ``world``); rank 0's return value is the result. Both sides of a
comparison run in the
same processes, interleaved repeat by repeat, so a ratio is always taken within one run
(the machine is noisy). ``python -m benchmarks`` (:mod:`benchmarks.driver`, ``make bench``)
launches the parts under ``mpirun`` (ranks: :mod:`benchmarks.worker`) and writes
``bench.json`` and ``bench.md`` (see :mod:`benchmarks.report`). A top-level package of the
checkout, not installed with hpctrain: run it from the repository root.

A result is a dict::

    {"bench": name, "ranks": n, "size": "tiny"|"small", "repeats": r, "what": str,
     "rows":   [{"variant", "median", "unit", "samples"}],
     "ratios": [{"name", "value", "ratio", "target", "met",  # target is text: ">= 1.1"
                 "spread", "pairs", "noise"}],  # interleaved A/B pairs: [min, max], count,
                                                # and whether the spread covers 1.0
     "check":  {"what", "values", "rel_err", "tol", "ok"},  # both sides computed the same
     "notes":  [str], "table": [...],                        # table: optional extra rows
     "load": {"before": [1, 5, 15 min], "after": [...]}}     # set by the worker
"""

from __future__ import annotations

# name -> world sizes it runs at; the module is benchmarks.<name>.
BENCHES = {
    "gradsync": (2, 4),
    "overlap": (2, 4),  # exposed gradient-sync time; how overlapped reductions progress
    "ddp": (2,),
    "pipeline": (2, 4),
    "overhead": (1,),
    "collectives": (4,),
    "checkpoint": (2, 4),  # save/load bandwidth vs per-rank torch.save (checkpoint issue)
    "memory": (1, 2, 4),  # ZeRO 0/1/2 peak memory and step time (ZeRO issue)
    "scaling": (1, 2, 4),  # "just add devices": naive design vs hpctrain's, efficiency
    "cluster": (1,),  # 2 simulated nodes: placement, hierarchical dp, overlap, scaling
    "nodes": (1,),  # 2 simulated nodes: hpctrain vs naive, DDP, FSDP2 and the bound
    "data": (1, 2, 4),  # prepare vs the tokenizers library; data share of a step; RSS vs corpus
    "context_kinds": (2, 4),  # ring vs Ulysses vs hybrid: step time, peak memory
    "relaunch": (1,),  # time to recover and steps lost: requeue vs relaunch (--size small)
    "faults": (1,),  # a seeded fault campaign on 3 simulated nodes: survived, steps lost
    "fuzz-foreign": (1,),  # 10,000 mutated foreign checkpoints through hpctrain import
    "interchange": (1,),  # peak memory of each import and export vs largest tensor x 2
}
SIZES = ("tiny", "small")
# name -> seconds one launch of it may take at --size small with 5 repeats (about three
# times a quiet run): a part past it is stopped and reported, the others still run. Scaled
# by repeats / 5 above 5, a third of it at --size tiny.
BUDGETS = {"gradsync": 300, "overlap": 600, "ddp": 300, "pipeline": 600, "overhead": 300,
           "collectives": 300, "checkpoint": 600, "memory": 600, "scaling": 600,
           "cluster": 900, "nodes": 900, "data": 600, "context_kinds": 600, "relaunch": 900,
           "faults": 1800, "fuzz-foreign": 5400, "interchange": 1800}


def module(name: str) -> str:
    """The module of part ``name`` (``fuzz-foreign``: ``benchmarks.fuzz_foreign``)."""
    return name.replace("-", "_")
