"""The performance model behind ``hpctrain plan --cluster/--search/--calibrate`` (no MPI
except ``calibrate.py``, which measures through ``comm``).

- ``cluster.py``: cluster descriptions (``share/clusters/*.toml``): peak FLOP/s, memory,
  ranks per node, alpha-beta links inside and between nodes, collective algorithm.
- ``cost.py``: a step's time per rank (compute, tp/cp/ep/pp/dp communication, ZeRO-3
  gathers, bubble from the schedule simulator, optimizer, checkpoint), tokens/s, MFU, memory.
- ``search.py``: every layout (dp, tp, pp, cp, schedule incl. zbv, ZeRO 0-3, ...) that fits,
  ranked by predicted step time; why the others not.
- ``published.py``: published runs (Megatron-LM, torchtitan, Frontier) against the model.
- ``calibrate.py``: this machine's compute rate and collective costs -> a description.
"""
