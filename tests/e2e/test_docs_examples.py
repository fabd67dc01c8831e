"""The docs' marked command examples print what the docs show (tests/docs_examples.py), and
the sbatch line of ``plan --search`` plans, through ``jobs/dry-run.sh``, the layout and the
predicted step the search chose for it."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
from docs_examples import differences, examples, run
from launch import ROOT, env

pytestmark = pytest.mark.e2e

DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if examples(p))


@pytest.fixture(scope="module")
def outputs():
    """Every marked example's output, each command run once: (example, stdout) pairs."""
    return [(ex, run(ex, env=env())) for path in DOCS for ex in examples(path)]


def test_docs_examples_print_what_the_docs_show(outputs):
    assert any(ex.path.name == "planning.md" for ex, _ in outputs)
    bad = [line for ex, out in outputs for line in differences(ex, out)]
    assert not bad, ("docs examples differ from the commands' output (regenerate with "
                     "`python tests/docs_examples.py --write FILE.md`):\n" + "\n".join(bad))


def _best(out: str) -> re.Match:
    return re.search(r"^\s+1\. (dp=(\d+) tp=(\d+) pp=(\d+)\S* .*?) +step (\S+) s, ([\d,]+) "
                     r"tok/s/rank, MFU ([\d.]+)%.*memory (.+)$", out, re.M)


def test_search_sbatch_line_dry_runs_to_the_same_plan(outputs):
    """The worked example's sbatch line, with jobs/dry-run.sh in place of sbatch: the same
    world, layout, device, memory and predicted step time as the search's best layout (so
    the user's --set model.* overrides, the nodes, tasks and GPUs all reached the plan)."""
    ex, out = next((e, o) for e, o in outputs if "--search" in e.command)
    best = _best(out)
    line = out.strip().splitlines()[-1].strip()
    words = shlex.split(line)
    assert words[0] == "sbatch" and "--gpus-per-node=4" in words and "jobs/gpu.sbatch" in words
    for kv in re.findall(r"--set (\S+)", ex.command.replace("\\\n", " ")):
        assert shlex.split(kv)[0] in words, f"{kv} missing from the sbatch line: {line}"
    proc = subprocess.run(["bash", "jobs/dry-run.sh", *words[1:]], cwd=ROOT, text=True,
                          env=env(PLAN_ARGS="--cluster dgx-a100"), capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout
    dp, tp, pp = best.group(2, 3, 4)
    assert "256 tasks on 64 node(s), device cuda" in plan, plan
    assert re.search(rf"^256 ranks: dp={dp} \(ep=1\) x tp={tp} x pp={pp}\b", plan, re.M), plan
    step = re.search(r"^  step (\S+) s:", plan, re.M)
    assert step and step.group(1) == best.group(5), (best.group(0), plan[-2000:])
    rate = re.search(r"\(([\d,]+) per rank\), MFU ([\d.]+)%, memory (\S+ \S+) of", plan)
    assert rate.groups() == (best.group(6), best.group(7), best.group(8)), plan[-2000:]
