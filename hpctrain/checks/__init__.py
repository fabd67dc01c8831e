"""Whether a configuration can run, before any collective: every problem at once.

- ``keys.py``: the rules each key declares beside itself (``hpctrain.config.key``), enforced
  by one function, and the reference docs/config.md generated from them.
- ``rules.py``: the rules that span keys or sections and the layout arithmetic, as messages.
- ``validate.py``: :func:`validate`: the rules, then what needs the pipeline split or the
  schedule builder.
- ``inputs.py``: what a valid config points at (the data, the run and checkpoint
  directories), checked by ``hpctrain train`` and ``hpctrain plan``.
"""
