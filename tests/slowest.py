"""``python tests/slowest.py N JUNIT.xml ...``: the N slowest tests of the suite's phases (the
JUnit files tests/run_all.sh has pytest write), setup and teardown included, one per line."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def durations(paths: list[Path]) -> list[tuple[float, str]]:
    """(seconds, test id) of every test case in the files that exist."""
    out = []
    for path in paths:
        if not path.is_file():
            print(f"(no {path}: that phase wrote no report)")
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            out.append((float(case.get("time", 0)), name))
    return sorted(out, reverse=True)


def main(argv: list[str]) -> int:
    n, files = int(argv[0]), [Path(a) for a in argv[1:]]
    rows = durations(files)
    print(f"== the {min(n, len(rows))} slowest of {len(rows)} tests "
          f"({sum(t for t, _ in rows):.0f} s in all)")
    for seconds, name in rows[:n]:
        print(f"{seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
