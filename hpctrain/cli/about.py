"""What ``hpctrain --help`` and ``hpctrain --version`` say, and the help formatter every
subcommand uses: prose is wrapped to the terminal, indented lines (examples) are kept as
written, and each option's help ends with its default (or says it is required) unless the
help text states the default itself."""

from __future__ import annotations

import argparse
import sys
import textwrap

DESCRIPTION = """\
hpctrain trains large neural networks (Llama, Mixtral-style experts, GPT-2) on clusters and
supercomputers with plain MPI: every rank is one process started by mpirun or srun, and data
(with ZeRO 1-3), tensor, sequence, pipeline, expert and context parallelism are axes of one
grid of ranks. Every layout trains the same model as one rank, and any layout resumes from
any checkpoint (one parallel-HDF5 file)."""

EPILOG = """\
Launching under MPI: train runs on every rank of an MPI job (so can prepare and plan
--calibrate); start it with the site's launcher, one rank per core or per GPU:

  mpirun -n 4 hpctrain train share/configs/demo.toml --run-dir runs/demo
  srun -n 4 hpctrain train share/configs/demo.toml --run-dir runs/demo
  hpctrain launch -n 4 -- hpctrain train share/configs/demo.toml \\
      --run-dir runs/demo

srun runs inside a SLURM allocation (some sites need srun --mpi=pmix); hpctrain launch finds
mpirun, mpiexec or srun and the flags each needs. The layout is set in the config, e.g.
--set topology.dp=2 --set topology.tp=2, and must multiply to the number of ranks (hpctrain
plan CONFIG checks it without MPI). The other commands run as one ordinary process.

'hpctrain COMMAND --help' describes each command; the config keys are in docs/config.md,
the guides in docs/ (README.md first)."""

DETAILS = {  # each command's description, where its module sets none
    "launch": "Start a command on N ranks with the launcher this machine has (Open MPI's "
              "mpirun, MPICH's mpiexec or srun) and the flags each needs for more ranks than "
              "cores, running as root, binding and passing the environment.",
    "prepare": "Turn text files (JSONL and Parquet shards, directories, globs) or a nanoGPT/"
               "Megatron token file into a token dataset (HDF5) with a held-out split chosen "
               "by document content. One process, or every rank under mpirun/srun (the file "
               "is the same for any number of ranks). docs/data.md.",
    "tokenizer": "Train a byte-level BPE tokenizer (tokenizer.json) on text files or the "
                 "embedded corpus, offline and deterministic.",
    "inspect": "Show a checkpoint's tensors, shapes, dtypes, lineage and how it was written "
               "(--verify recomputes every checksum), or a prepared data file's contents.",
    "import": "Turn a checkpoint of another format (a Hugging Face directory; a torchtitan "
              "or Megatron-Core DCP with --config) into an hpctrain checkpoint that any "
              "layout resumes or starts from; foreign files are read as data and checked "
              "before anything is written (docs/interchange.md#formats).",
    "generate": "Continue a prompt with a model: a checkpoint of any layout, or a Hugging "
                "Face Llama/Mixtral/Qwen-MoE directory, on one process (no MPI).",
    "report": "Plots and a Markdown summary of where a run's time went (needs matplotlib).",
}


class Formatter(argparse.HelpFormatter):
    """Descriptions and epilogs: paragraphs wrapped to the terminal, indented lines (commands,
    examples) kept as written; every option's help ends with its default."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        prose: list[str] = []
        for line in [*text.splitlines(), None]:
            if line and not line.startswith(" "):
                prose.append(line)
                continue
            if prose:  # paths and options stay whole
                out.append(textwrap.fill(" ".join(prose), width, initial_indent=indent,
                                         subsequent_indent=indent, break_on_hyphens=False,
                                         break_long_words=False))
                prose = []
            if line is not None:
                out.append(indent + line)
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return f"{text} ({shown})" if (shown := default_note(action, text)) else text

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # room for the commands' names
            for sub in action._get_subactions():
                width = len(self._format_action_invocation(sub)) + self._current_indent + 4
                self._action_max_length = max(self._action_max_length, width)


def default_note(action: argparse.Action, text: str) -> str:
    """"default: X" or "required" for ``action``'s help; "" when the help says it already,
    for flags (off unless given) and for what argparse shows itself (--help, --version)."""
    if action.help == argparse.SUPPRESS or action.nargs == 0 or "default" in text.lower():
        return ""
    if action.required:
        return "required" if action.option_strings else ""
    if action.nargs == argparse.REMAINDER or action.default in (None, ""):
        return ""  # no value to show: the help text must say what happens without it
    if action.default == []:
        return "default: none"
    value = action.default
    if isinstance(value, str) and value != value.strip():
        value = repr(value)  # the spaces matter
    return f"default: {value}".replace("%", "%%")


def version() -> str:
    """``hpctrain 0.1.0 (commit 1a2b3c4...)``: the package version and the commit of the
    code that runs, as a checkpoint's lineage records it."""
    from .. import __version__
    from ..checkpoint.integrity import git_commit

    return f"hpctrain {__version__} (commit {git_commit()})"


class VersionAction(argparse.Action):
    """``--version``: the commit is looked up only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        sys.stdout.flush()
        parser.exit()


def format_all(parser: argparse.ArgumentParser) -> None:
    """Give every (nested) subcommand parser the :class:`Formatter`."""
    parser.formatter_class = Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                format_all(sub)


# -- docs/commands.md: every command's options, from the parser itself -----------------------

REGENERATE = ("python -c 'import hpctrain.__main__ as m; print(m.reference(), end=\"\")' "
              "> docs/commands.md")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _prose(text: str, code_too: bool = True) -> list[str]:
    """A description or epilog as Markdown: paragraphs joined, indented lines (commands,
    examples) as a code block (left out unless ``code_too``: a description's lists of
    options repeat the table)."""
    out: list[str] = []
    para: list[str] = []
    code: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith(" "):
            if para:
                out += [" ".join(para), ""]
                para = []
            code.append(line[2:] if line.startswith("  ") else line.lstrip())
            continue
        if code and code_too:
            out += ["```bash", *code, "```", ""]
            code = []
        if line.strip():
            para.append(line.strip())
        elif para:
            out += [" ".join(para), ""]
            para = []
    return out


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["|argument|meaning|", "|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            name = action.metavar or action.dest.upper()
        elif action.metavar is None and action.choices is None:  # no name for its value
            name = ", ".join(action.option_strings)
        else:
            name = formatter._format_action_invocation(action)
        rows.append(f"|`{_cell(name)}`|{_cell(formatter._expand_help(action))}|")
    return rows


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = [f"## {name}", "", *_prose(parser.description or summary, code_too=False)]
    if not subs:
        out += [*_options(parser), ""]
    if parser.epilog:
        out += _prose(parser.epilog)
    for action in subs:
        helps = {a.dest: a.help for a in action._get_subactions()}
        for sub_name, sub in action.choices.items():
            out += _command(f"{name} {sub_name}", sub, helps.get(sub_name, ""))
    return out


def markdown(parser: argparse.ArgumentParser, commands: dict[str, str]) -> str:
    """docs/commands.md: each command of ``parser`` (``commands``: name -> one line) with its
    description, usage, every argument with its help and default, and its examples."""
    out = ["# Command reference", "",
           f"<!-- Generated from the CLI's parser; do not edit. Regenerate: {REGENERATE} -->",
           "", "`hpctrain COMMAND --help` prints the same; `--set` takes the keys of "
           "[config.md](config.md).", "",
           "|command|what it does|", "|---|---|"]
    out += [f"|[`{n}`](#hpctrain-{n})|{_cell(h)}|" for n, h in commands.items()]
    out.append("")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        out += _command(f"hpctrain {name}", p, commands.get(name, ""))
    return "\n".join(out).rstrip("\n") + "\n"
