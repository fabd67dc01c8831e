"""``hpctrain submit [SBATCH OPTIONS] jobs/T.sbatch [CONFIG] [ARGS]``: the pre-flight, then
``sbatch`` with the same line."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from ..job.launch import ROOT

DESCRIPTION = """\
Check a batch job on the login node, then submit it: runs jobs/dry-run.sh with the line
(the template as the job would, up to the job step: the site file, CONFIG, RUN_NAME,
LAYOUT, OVERRIDES; then every check `hpctrain train` makes at start: config, layout
against the requested tasks, data and tokenizer, directories, whether the run is new or
continues from a checkpoint; then `hpctrain plan`), and only when all pass, `sbatch` with
the same line. A job that would be refused exits 2 here instead of after the queue wait."""

EPILOG = """\
examples:
  hpctrain submit --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 \\
      jobs/gpu.sbatch share/configs/llama3-8b.toml
  hpctrain submit jobs/single-node.sbatch share/configs/tiny.toml \\
      --set train.steps=20
  hpctrain submit --dependency=afterany:1234 jobs/preemptible.sbatch CONFIG

The run directory is named by the run (RUN_NAME or --run-name, default the config's
stem), never by the job id: submitting the same line again, or chaining jobs with
--dependency=afterany, continues the run from its newest checkpoint (docs/slurm.md)."""


def add_arguments(p) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    p.add_argument("line", nargs=argparse.REMAINDER, metavar="[SBATCH OPTIONS] TEMPLATE ...",
                   help="what would follow `sbatch`: its options, the template, the config "
                        "and hpctrain's arguments")


VERBATIM = True  # run() takes the words after `submit` as sbatch would see them


def run(words: list[str]) -> int:
    line = words[1:] if words[:1] == ["--"] else words
    if not line:
        print("hpctrain submit: no template; usage: hpctrain submit [SBATCH OPTIONS] "
              "jobs/T.sbatch [CONFIG] [ARGS]", file=sys.stderr)
        return 2
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print("hpctrain submit: sbatch is not on the PATH (a SLURM login node has it; "
              "jobs/dry-run.sh checks a line without it)", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHON=os.environ.get("PYTHON") or sys.executable)
    checked = subprocess.run(["bash", str(ROOT / "jobs/dry-run.sh"), *line], env=env)
    if checked.returncode != 0:
        print(f"hpctrain submit: not submitted: the pre-flight above failed "
              f"(exit {checked.returncode})", file=sys.stderr)
        return 2
    os.execv(sbatch, [sbatch, *line])
    return 0  # not reached
