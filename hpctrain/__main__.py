"""hpctrain: train large neural networks with plain MPI (one process per rank).

Each subcommand lives in ``hpctrain/cli/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; add a new one to COMMANDS.

Training is launched on every rank, under MPI:
    mpirun -n 4 hpctrain train share/configs/demo.toml --run-dir runs/demo
(an exception on any rank aborts the whole job, never a hang: ``comm.abort_on_exception``,
installed by each subcommand that uses MPI; ``python -m mpi4py -m hpctrain`` does the same).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "launch": "start a command on N ranks with this machine's launcher (mpirun, mpiexec, srun)",
    "train": "train a model (run under mpirun/srun, one process per rank)",
    "prepare": "turn text files (or a nanoGPT/Megatron corpus) into a token dataset (HDF5) "
               "with a held-out split; in parallel under mpirun",
    "tokenizer": "train a byte-level BPE tokenizer (tokenizer.json) on text files",
    "plan": "plan a layout without MPI: schedule, bubble and memory per rank; --cluster: the "
            "predicted step time; --search: the best layouts on --nodes nodes; --calibrate: "
            "describe this machine (under mpirun); --published: the published runs",
    "inspect": "show a checkpoint's tensors and lineage; --verify recomputes checksums",
    "export": "export a checkpoint's model as safetensors, or as a Hugging Face directory",
    "import": "turn a Hugging Face Llama/Mixtral directory into an hpctrain checkpoint",
    "report": "plots and a Markdown summary of where a run's time went (needs matplotlib)",
    "generate": "continue a prompt with a checkpoint's model (any layout's, on one process)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"hpctrain.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    args, extra = parser.parse_known_args(argv)
    trailing = getattr(args._module, "TRAILING", None)  # an optional positional that may
    if extra and trailing and getattr(args, trailing) is None:  # follow the options
        setattr(args, trailing, extra.pop(0))
    if extra:
        parser.parse_args(argv)  # argparse's own message for what is left over
    return args._module.run(args)


if __name__ == "__main__":
    sys.exit(main())
