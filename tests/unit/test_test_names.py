"""pytest imports test modules by basename (no package __init__ in tests/): two test files of
the same name in different folders stop the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], names.most_common(3)
