"""``hpctrain prepare`` streams: the peak RSS of the process does not grow with the corpus
(two JSONL corpora 10x apart, each prepared in a fresh process: its own peak, ``VmHWM``;
``ru_maxrss`` would include the parent's RSS, which a child inherits at fork and exec;
measured by the ``data`` benchmark's :func:`benchmarks.data.peak_rss`)."""

import json
from pathlib import Path

from benchmarks.data import peak_rss


def write_corpus(path: Path, mb: float, doc_bytes: int = 2000) -> None:
    """``mb`` MiB of JSONL, one document of about ``doc_bytes`` per line, written a block at
    a time."""
    line = json.dumps({"text": ("lorem ipsum dolor sit amet " * doc_bytes)[:doc_bytes]})
    lines = int(mb * 2**20) // (len(line) + 1)
    with open(path, "w") as f:
        for a in range(0, lines, 1000):
            f.write("".join(line[:-3] + f"{i}" + line[-3:] + "\n"
                            for i in range(a, min(lines, a + 1000))))


def test_peak_rss_does_not_grow_with_the_corpus(tmp_path):
    rss = {}
    for mb in (5, 50):
        write_corpus(tmp_path / f"c{mb}.jsonl", mb)
        rss[mb] = peak_rss(tmp_path / f"c{mb}.jsonl", tmp_path / f"d{mb}.h5")
        (tmp_path / f"c{mb}.jsonl").unlink()
    print(f"peak RSS: 5 MiB corpus {rss[5]:.1f} MiB, 50 MiB corpus {rss[50]:.1f} MiB")
    assert rss[50] < 1.3 * rss[5] + 30, rss
