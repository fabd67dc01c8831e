"""The commit a checkpoint records (``git_commit``) is the commit of the code that ran, found
from the package's own directory whatever the working directory, or "unknown" for code
outside git: never an empty string."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the checkpoint's attribute and the run's lineage.json (``lineage.collect``) say the same
PROBE = ("from hpctrain.checkpoint import integrity, lineage\n"
         "c = integrity.git_commit()\n"
         "assert lineage.collect({}, (1,), 1)['commit'] == c\n"
         "print(repr(c))")


def commit_seen(pythonpath: Path, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True,
                         env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
                         timeout=120, check=True)
    return eval(out.stdout.strip())


def test_a_checkout_run_from_elsewhere_records_its_commit(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    seen = commit_seen(ROOT, tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", seen) and seen.startswith(head), seen


def test_a_copy_outside_git_says_unknown(tmp_path):
    shutil.copytree(ROOT / "hpctrain", tmp_path / "pkg" / "hpctrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert commit_seen(tmp_path / "pkg", tmp_path) == "unknown"
