"""Subcommands of the ``hpctrain`` CLI, one module each."""
