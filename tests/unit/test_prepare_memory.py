"""``hpctrain prepare`` streams: the peak RSS of the process does not grow with the corpus
(two JSONL corpora 10x apart, each prepared in a fresh process: its own peak, ``VmHWM``;
``ru_maxrss`` would include the parent's RSS, which a child inherits at fork and exec)."""

import json
import os
import subprocess
import sys
from pathlib import Path

MEASURE = """
import resource, sys
from hpctrain.data.prepare import prepare, text_source
from hpctrain.data.tokenizer import byte_level
prepare(text_source([sys.argv[1]]), byte_level(), sys.argv[2], 0.05)
try:  # this process's own peak: ru_maxrss would include the parent's at exec
    print([int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")][0])
except OSError:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_corpus(path: Path, mb: float, doc_bytes: int = 2000) -> None:
    """``mb`` MiB of JSONL, one document of about ``doc_bytes`` per line, written a block at
    a time."""
    line = json.dumps({"text": ("lorem ipsum dolor sit amet " * doc_bytes)[:doc_bytes]})
    lines = int(mb * 2**20) // (len(line) + 1)
    with open(path, "w") as f:
        for a in range(0, lines, 1000):
            f.write("".join(line[:-3] + f"{i}" + line[-3:] + "\n"
                            for i in range(a, min(lines, a + 1000))))


def peak_rss_mib(corpus: Path, out: Path) -> float:
    """Peak RSS (MiB) of a fresh process that prepares ``corpus`` byte-level."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HPCTRAIN_PREPARE_SERIAL": "1"}
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(corpus), str(out)], env=env,
                          capture_output=True, text=True, check=True, timeout=300)
    return int(proc.stdout.split()[-1]) / 1024  # Linux: KiB


def test_peak_rss_does_not_grow_with_the_corpus(tmp_path):
    rss = {}
    for mb in (5, 50):
        write_corpus(tmp_path / f"c{mb}.jsonl", mb)
        rss[mb] = peak_rss_mib(tmp_path / f"c{mb}.jsonl", tmp_path / f"d{mb}.h5")
        (tmp_path / f"c{mb}.jsonl").unlink()
    print(f"peak RSS: 5 MiB corpus {rss[5]:.1f} MiB, 50 MiB corpus {rss[50]:.1f} MiB")
    assert rss[50] < 1.3 * rss[5] + 30, rss
