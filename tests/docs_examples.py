"""Docs examples that are the command's own output: find them, rerun them, compare, rewrite.

A fenced ``bash`` block directly preceded by the line ``<!-- example: output below -->`` is
run from the checkout root by ``bash -e`` (``python`` is this interpreter: its directory
comes first on PATH), and the next fenced block (```` ```text ````) must be what it prints
on stdout. The rule for numbers that depend on the machine (timings, measured rates):
the documentation writes them as ``<N>``, which matches any number; everything else must
match exactly. ``python tests/docs_examples.py [--write] FILE.md ...`` reruns every marked
example of the files and prints the differences, or with ``--write`` replaces each output
block by what the command printed now (keeping the ``<N>`` of lines whose other text is
unchanged).
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- example: output below -->"
ANY_NUMBER = "<N>"
_NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?"
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Example:
    path: Path
    line: int  # 1-based line of the command block's opening fence
    command: str
    expected: str
    span: tuple[int, int]  # the output block's content lines [start, stop), 0-based


def _fenced(lines: list[str], start: int) -> tuple[str, int, int]:
    """The block whose opening fence is lines[start]: (language, first, stop) content lines."""
    lang = _FENCE.match(lines[start]).group(1)
    for end in range(start + 1, len(lines)):
        if lines[end].rstrip() == "```":
            return lang, start + 1, end
    raise ValueError(f"line {start + 1}: unclosed fenced block")


def examples(path: Path) -> list[Example]:
    """Every marked example of a markdown file; a marker without its two blocks is an error
    naming the file and line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, text in enumerate(lines):
        if text.strip() != MARKER:
            continue
        where = f"{path}:{i + 1}"
        if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
            raise ValueError(f"{where}: {MARKER} must be followed by a ```bash block")
        lang, first, stop = _fenced(lines, i + 1)
        nxt = next((j for j in range(stop + 1, len(lines)) if lines[j].strip()), None)
        if lang != "bash" or nxt is None or not _FENCE.match(lines[nxt]):
            raise ValueError(f"{where}: expected a ```bash block, then a ```text output block")
        _, o_first, o_stop = _fenced(lines, nxt)
        out.append(Example(path, i + 2, "\n".join(lines[first:stop]),
                           "\n".join(lines[o_first:o_stop]), (o_first, o_stop)))
    return out


def run(example: Example, timeout: float = 300, env: dict | None = None) -> str:
    """What the example's commands print on stdout (stderr is not part of the output)."""
    e = dict(os.environ if env is None else env)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    proc = subprocess.run(["bash", "-e", "-c", example.command], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{example.path}:{example.line}: exited {proc.returncode}\n"
                             f"{example.command}\n{proc.stderr[-3000:]}")
    return proc.stdout.rstrip("\n")


def line_matches(expected: str, actual: str) -> bool:
    parts = [re.escape(p) for p in expected.split(ANY_NUMBER)]
    return re.fullmatch(_NUMBER.join(parts), actual) is not None


def differences(example: Example, actual: str) -> list[str]:
    """Lines of a unified diff where the output and the doc differ (``<N>`` honoured)."""
    want, got = example.expected.splitlines(), actual.splitlines()
    if len(want) == len(got) and all(map(line_matches, want, got)):
        return []
    return list(difflib.unified_diff(want, got, f"{example.path}:{example.line} (doc)",
                                     "the command now", lineterm=""))


def rewrite(path: Path, outputs: list[str]) -> None:
    """Replace each marked example's output block by ``outputs`` (in order), keeping the
    doc's line wherever it still matches (its ``<N>`` stay)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for ex, actual in reversed(list(zip(examples(path), outputs))):
        want = ex.expected.splitlines()
        new = [want[i] if i < len(want) and line_matches(want[i], a) else a
               for i, a in enumerate(actual.splitlines())]
        lines[ex.span[0]:ex.span[1]] = new
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    write = "--write" in argv
    bad = 0
    for name in (a for a in argv if a != "--write"):
        path = Path(name)
        exs = examples(path)
        outputs = [run(ex) for ex in exs]
        if write:
            rewrite(path, outputs)
            print(f"{path}: {len(exs)} example(s) rewritten")
            continue
        for ex, actual in zip(exs, outputs):
            diff = differences(ex, actual)
            bad += bool(diff)
            print("\n".join(diff) if diff else f"{path}:{ex.line}: same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
