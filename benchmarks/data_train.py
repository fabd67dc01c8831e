"""The training side of the ``data`` part: short ``hpctrain train`` runs (the real CLI, a
fresh process each, no MPI job) on prepared corpora 10x apart. From each run's
``metrics.jsonl`` the share of ``data_s`` in the step with the read-ahead on and off
(interleaved), and from the process itself its peak RSS (VmHWM, printed when the command
returns) on the small and the large corpus."""

from __future__ import annotations

import json
from pathlib import Path

from .common import COMMON, TRAIN_PRESETS, in_fresh_process, median, pairs_of, ratio, row

TRAIN_MB = {"tiny": 0.3, "small": 5.0}  # the small corpus; the large one is 10x
STEPS = {"tiny": 8, "small": 20}
CLI = """
from hpctrain.__main__ import main
rc = main(sys.argv[1:])
"""


def corpus(tmp: Path, mb: float) -> str:
    """A byte-level prepared file of about ``mb`` MiB of tokens (JSONL.zst + Parquet shards
    of :func:`benchmarks.data.shards`, prepared by this process alone)."""
    from hpctrain.data.prepare import prepare, text_source
    from hpctrain.data.tokenizer import byte_level

    from .data import shards

    top, out = tmp / f"train{mb:g}", tmp / f"train{mb:g}.h5"
    shards(top, mb)
    prepare(text_source([str(top)]), byte_level(), str(out), 0.05)
    return str(out)


def train_once(path: str, run_dir: Path, size: str, prefetch: bool) -> dict:
    """One ``hpctrain train`` run in a fresh process: its metrics rows after the first
    (``data`` and ``step`` seconds), the first step's, and its peak RSS in MiB."""
    sets = [*COMMON, *TRAIN_PRESETS[size], f"train.steps={STEPS[size]}", "topology.dp=1",
            "train.eval_every=0", "checkpoint.every=0",
            f'data.path="{path}"', f"data.prefetch={'true' if prefetch else 'false'}"]
    argv = ["train", "share/configs/demo.toml", "--run-dir", str(run_dir)]
    argv += [a for s in sets for a in ("--set", s)]
    _, rss = in_fresh_process(CLI, argv, cwd=Path(__file__).resolve().parent.parent)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    share = [r["time_s"].get("data", 0.0) / r["step_time_s"] for r in rows]
    return {"share": median(share[1:] or share), "first": share[0],
            "data_s": median([r["time_s"].get("data", 0.0) for r in rows[1:] or rows]),
            "rss": rss}


def measure(tmp: Path, size: str, repeats: int) -> dict[str, list[dict]]:
    """Interleaved runs (order reversed every other round): read-ahead on and off on the
    small corpus, read-ahead on on the large one. Name -> one dict per run."""
    paths = {mb: corpus(tmp, mb) for mb in (TRAIN_MB[size], 10 * TRAIN_MB[size])}
    small, big = sorted(paths)
    variants = {"on": (small, True), "off": (small, False), "big": (big, True)}
    out: dict[str, list[dict]] = {n: [] for n in variants}
    for r in range(pairs_of(repeats, size)):
        for n in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            mb, prefetch = variants[n]
            out[n].append(train_once(paths[mb], tmp / f"run-{n}-{r}", size, prefetch))
    return out


def figures(tmp: Path, size: str, repeats: int) -> tuple[list[dict], list[dict], list[str]]:
    """Rows, ratios and notes of the training side (one rank, no MPI job of its own)."""
    runs = measure(tmp, size, repeats)
    on, off, big = runs["on"], runs["off"], runs["big"]
    small_mb, big_mb = TRAIN_MB[size], 10 * TRAIN_MB[size]
    rows = [row("train: data share of a step, read-ahead on", [x["share"] for x in on], "x"),
            row("train: data share of a step, read-ahead off", [x["share"] for x in off], "x"),
            row(f"train: peak RSS, {small_mb:g} MiB corpus", [x["rss"] for x in on], "MiB"),
            row(f"train: peak RSS, {big_mb:g} MiB corpus", [x["rss"] for x in big], "MiB")]
    share = ratio("train: data share of a step with read-ahead", 0.0, "<= 0.01",
                  [x["share"] for x in on])
    if not share["met"]:
        share["why"] = (f"data_s {median([x['data_s'] for x in on]) * 1e3:.2f} ms of the "
                        f"step (median after the first); without read-ahead the share is "
                        f"{median([x['share'] for x in off]):.2%}; the first step, which "
                        f"nothing was read ahead for, {median([x['first'] for x in on]):.1%}")
    rss = ratio(f"train: peak RSS, {big_mb:g} MiB / {small_mb:g} MiB corpus", 0.0, "<= 1.1",
                [b["rss"] / a["rss"] for a, b in zip(on, big)])
    if not rss["met"]:
        rss["why"] = (f"peak RSS {median([x['rss'] for x in big]):.1f} MiB against "
                      f"{median([x['rss'] for x in on]):.1f} MiB")
    notes = [f"training ({STEPS[size]} steps, {size} preset, one rank, fresh `hpctrain train` "
             f"process): data share with read-ahead {share['value']:.3%}, without "
             f"{median([x['share'] for x in off]):.3%}; first step "
             f"{median([x['first'] for x in on]):.1%}; peak RSS "
             f"{median([x['rss'] for x in on]):.1f} MiB ({small_mb:g} MiB corpus) and "
             f"{median([x['rss'] for x in big]):.1f} MiB ({big_mb:g} MiB corpus)"]
    return rows, [share, rss], notes
