"""Stage 2's order of work: pipeline schedules as data, checked and executed.

- ``schedules.py``: the registry, one entry per schedule kind (its order, placement,
  chunks, in-flight activations, fill, split, F&B pairs) that the runner, the simulator,
  the checks, the planner and the memory estimate ask; ``build`` (also forward-only).
- ``actions.py``: :class:`Action` (``F3``, ``B3``, ``W3``, ``SF3``...), the kinds' compute
  orders (gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev) and the transfers, pure
  functions.
- ``placement.py``: which virtual stage sits on which pp rank, layer partitions.
- ``simulate.py``: all ranks' lists in one process: matching, order, deadlock, bubble
  (dualpipev's F&B pairs as one unit: ``paired``, ``pair_costs``).
- ``runner.py``: one rank's list executed with nonblocking p2p over ``pp_comm``; a receive
  is waited for by polling, then sleeping (``experimental.p2p_wait``). Training steps
  (``run_step``) and evaluation (``run_forward``, the forward-only schedule) alike; a
  zero-bubble backward splits into B (``input_grad``: all but the weight matmuls) and W (their
  weight gradients, from ``model.weight_grad``'s store).
- ``moe_overlap.py``: the pure planner that adds expert all-to-all actions (D/E/C/G...).
- ``moe_executor.py``: the runner's handlers for those actions.
"""
