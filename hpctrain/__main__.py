"""The ``hpctrain`` command: ``hpctrain COMMAND ...`` (``python -m hpctrain`` is the same).

Each subcommand lives in ``hpctrain/cli/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int`` (``VERBATIM = True``: ``run`` takes the words after the command as they
are, for ``submit``'s sbatch line); add a new one to COMMANDS (one line of help each).
What the top-level ``--help`` says to users is ``cli/about.py``.

Under MPI an exception on any rank aborts the whole job, never a hang
(``comm.abort_on_exception``, installed by each subcommand that uses MPI;
``python -m mpi4py -m hpctrain`` does the same).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

COMMANDS = {
    "train": "train a model (under mpirun/srun, one process per rank)",
    "plan": "predict memory and step time of a layout; search layouts",
    "launch": "start a command on N ranks with this machine's launcher",
    "submit": "check a batch job before the queue, then sbatch it",
    "prepare": "text files or a tokenized corpus -> a token dataset",
    "tokenizer": "train a byte-level BPE tokenizer (tokenizer.json)",
    "inspect": "a checkpoint's tensors and lineage; --verify checksums",
    "export": "a checkpoint as safetensors or a Hugging Face directory",
    "import": "a Hugging Face model directory as a checkpoint",
    "generate": "continue a prompt with a checkpoint's model",
    "report": "plots and a summary of where a run's time went",
}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand's options, every help text."""
    from .cli import about

    parser = argparse.ArgumentParser(prog="hpctrain", description=about.DESCRIPTION,
                                     epilog=about.EPILOG, formatter_class=about.Formatter)
    parser.add_argument("--version", action=about.VersionAction,
                        help="print the version and the commit of the code, then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"hpctrain.cli.{name}")
        p = sub.add_parser(name, help=help_text,
                           description=about.DETAILS.get(name, help_text))
        module.add_arguments(p)
        p.set_defaults(_module=module)
    about.format_all(parser)
    return parser


def reference() -> str:
    """docs/commands.md, generated from :func:`build_parser` (``cli.about.REGENERATE``)."""
    from .cli import about

    return about.markdown(build_parser(), COMMANDS)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args._module, "VERBATIM", False):  # the words after the command, untouched
        words = sys.argv[1:] if argv is None else list(argv)
        return args._module.run(words[words.index(args.command) + 1:])
    trailing = getattr(args._module, "TRAILING", None)  # an optional positional that may
    if extra and trailing and getattr(args, trailing) is None:  # follow the options
        setattr(args, trailing, extra.pop(0))
    if extra:
        parser.parse_args(argv)  # argparse's own message for what is left over
    return args._module.run(args)


def finish(status: int) -> None:
    """End this process with ``status``. What is still alive (torch's modules among it) is
    frozen out of the garbage collector first, so that the interpreter's last collection does
    not walk it: about 0.4 s of a core for every rank of every command, spent on memory the
    process is about to give back. Exit handlers, MPI's finalisation and the closing of files
    run as always."""
    gc.freeze()
    sys.exit(status)


def program() -> None:
    """``hpctrain`` as a process (the console script, ``python -m hpctrain``)."""
    finish(main())


if __name__ == "__main__":
    program()
