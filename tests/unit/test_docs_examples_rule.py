"""The comparison rule of tests/docs_examples.py: exact text, ``<N>`` for any number, and a
marker without its two blocks named by file and line."""

from __future__ import annotations

import pytest
from docs_examples import MARKER, Example, differences, examples, line_matches, rewrite


@pytest.mark.parametrize("doc,out,same", [
    ("covers <N> epochs (<N> samples)", "covers 0.0323 epochs (29,759 samples)", True),
    ("step <N> s", "step 1.5e-05 s", True),
    ("step <N> s", "step fast s", False),
    ("dp=8 tp=4", "dp=8 tp=2", False),
    ("a.b (c)", "a.b (c)", True),
])
def test_any_number_and_nothing_else(doc, out, same):
    assert line_matches(doc, out) is same


def test_differences_and_rewrite_keep_the_placeholders(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(f"text\n{MARKER}\n```bash\necho hi\n```\n\n```text\nrate <N> /s\nold\n```\n")
    (ex,) = examples(md)
    assert isinstance(ex, Example) and ex.command == "echo hi" and ex.line == 3
    assert differences(ex, "rate 12 /s\nold") == []
    assert any(line.startswith("+new") for line in differences(ex, "rate 12 /s\nnew"))
    rewrite(md, ["rate 7 /s\nnew"])
    assert "rate <N> /s\nnew\n```" in md.read_text()


def test_a_marker_without_its_blocks_is_named(tmp_path):
    md = tmp_path / "y.md"
    md.write_text(f"{MARKER}\nno block\n")
    with pytest.raises(ValueError, match=r"y.md:1: .* must be followed by a ```bash block"):
        examples(md)
