"""Whether a configuration can run, before any collective: every problem at once.

- ``rules.py``: the rules of the configuration and the layout arithmetic, as messages.
- ``checks/validate.py``: :func:`validate`: the rules, then what needs the pipeline split or the
  schedule builder.
"""
