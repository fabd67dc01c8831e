"""The documentation points at things that exist: every relative link of README.md and
docs/*.md names a file of the checkout and, with ``#anchor``, a heading (or ``<a id>``) of
that file; every repository path written in backquotes with a file extension
(``hpctrain/checkpoint/read.py``, ``planner/cost.py``) names a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|toml|sbatch|json))`")
# where a path written relative to a package or the docs is looked for
PREFIXES = ("", "hpctrain/", "docs/", "share/")
EXTERNAL = {"docs/performance.md"}  # torchtitan's page, cited as a source of published runs


def slug(title: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped
    (``-`` and ``_`` kept), spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found = {slug(t) for t in re.findall(r"^#+ (.+)$", prose, flags=re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def test_slug_follows_the_renderer():
    assert slug("What `--search` recommends for them") == "what---search-recommends-for-them"
    assert slug("Atomic, durable commit") == "atomic-durable-commit"
    assert slug("The first run (2026-11-30)") == "the-first-run-2026-11-30"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    bad = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            bad.append(f"{target}: no file {path}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            bad.append(f"{target}: no heading #{anchor} in {where.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_paths_exist(page):
    missing = sorted({p for p in CODE_PATH.findall(page.read_text(encoding="utf-8"))
                      if not any((ROOT / prefix / p).exists() for prefix in PREFIXES)})
    placeholders = [p for p in missing if re.search(r"[A-Z]{3,}", p)]  # DIR/..., NAME.toml
    assert sorted(set(missing) - set(placeholders) - EXTERNAL) == [], page.name
