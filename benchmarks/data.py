"""``hpctrain prepare`` on JSONL and Parquet shards: documents per second per rank against
the tokenizers library's own batch encoding of the same documents (the limit: tokenization
alone, this rank's documents already in memory, one ``encode_batch`` call), interleaved, at
1, 2 and 4 ranks; on one rank also the peak RSS of a fresh process preparing two corpora 10x
apart (byte-level, so that the figure is the reader's and writer's, not the tokenizer's); on
one rank also short ``hpctrain train`` runs (:mod:`benchmarks.data_train`): the data share
of a step with and without read-ahead, and training's peak RSS on two corpora 10x apart."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import common
from .common import max_over_ranks, median, pair_ratios, pairs_of, ratio, result, row, scratch_dir
from .data_train import figures

RANKS = (1, 2, 4)
CORPUS_MB = {"tiny": 0.5, "small": 6.0}
VOCAB = 2048
RSS = """
from hpctrain.data.prepare import prepare, text_source
from hpctrain.data.tokenizer import byte_level
prepare(text_source([sys.argv[1]]), byte_level(), sys.argv[2], 0.05)
"""


def shards(top: Path, mb: float, n: int = 8) -> None:
    """``n`` shards of about ``mb`` MiB together, half JSONL.zst, half Parquet, documents of
    500 to 4000 bytes of code-like text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    top.mkdir(parents=True, exist_ok=True)
    per, k = int(mb * 2**20 / n), 0
    for s in range(n):
        docs, size = [], 0
        while size < per:
            words = " ".join(f"value_{(k * 7 + j) % 997} = compute({j}, {k % 13})"
                             for j in range(20 + k % 150))
            docs.append(f"# document {k}\n{words}\n")
            size, k = size + len(docs[-1]), k + 1
        if s % 2:
            pq.write_table(pa.table({"text": docs}), top / f"{s:02d}.parquet",
                           row_group_size=256)
        else:
            lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
            (top / f"{s:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))


def peak_rss(corpus, out) -> float:
    """MiB: the peak RSS of a fresh process (no MPI) preparing ``corpus`` (a file, directory
    or glob) byte-level into ``out`` (tests/unit/test_prepare_memory.py uses it too)."""
    serial = {"HPCTRAIN_PREPARE_SERIAL": "1"}
    return common.in_fresh_process(RSS, [str(corpus), str(out)], serial)[1]


def one_rank(world, tmp: Path, size: str, repeats: int) -> tuple[dict, tuple]:
    """On one rank (else nothing): prepare's peak RSS on two corpora 10x apart (corpus MiB
    -> MiB; not at ``tiny``: CI's test_prepare_memory checks the bound) and the training
    figures of :func:`benchmarks.data_train.figures`."""
    rss: dict = {}
    if world.size != 1:
        return rss, ([], [], [])
    if size != "tiny":
        for mb in (CORPUS_MB[size], 10 * CORPUS_MB[size]):
            shards(tmp / f"rss{mb}", mb)
            rss[mb] = peak_rss(tmp / f"rss{mb}", tmp / f"rss{mb}.h5")
    return rss, figures(tmp, size, repeats)


def memory(out: dict, rss: dict, training: tuple) -> None:
    """Add prepare's peak RSS (corpus MiB -> MiB, two corpora or none) and the training
    figures (rows, ratios, notes of :func:`benchmarks.data_train.figures`) to ``out``."""
    if rss:
        (small, a), (big, b) = sorted(rss.items())
        out["notes"].append(f"peak RSS of a fresh prepare process (byte-level): {small:g} MiB "
                            f"corpus {a:.1f} MiB, {big:g} MiB corpus {b:.1f} MiB")
        out["rows"].append(row(f"peak RSS, {big:g} MiB / {small:g} MiB corpus", [b / a], "x"))
    out["rows"] += training[0]
    out["ratios"] += training[1]
    out["notes"] += training[2]


def run(world, size: str, repeats: int) -> dict:
    from hpctrain.data.prepare import blocks, prepare, text_source
    from hpctrain.data.tokenizer import load, train_bpe

    with scratch_dir(world) as tmp:
        top, tok_path = Path(tmp) / "shards", Path(tmp) / "tok.json"
        if world.rank == 0:
            shards(top, CORPUS_MB[size])
            sample = text_source([str(top)])
            tok_path.write_text(train_bpe(sample.texts(0)[:300], VOCAB))
        world.barrier()
        tok = load(str(tok_path))
        src = text_source([str(top)], group=world)
        lo, hi = blocks(src.sizes, world.size)[world.rank]
        mine = [d.decode() for u in range(lo, hi) for d in src.texts(u)]
        lib = tok.library()
        attrs = {}

        def ours() -> float:
            t0 = time.perf_counter()
            attrs.update(prepare(text_source([str(top)], group=world), tok,
                                 str(Path(tmp) / "d.h5"), 0.05, world))
            return max_over_ranks(world, time.perf_counter() - t0)

        def limit() -> float:
            t0 = time.perf_counter()
            lib.encode_batch(mine, add_special_tokens=True)
            return max_over_ranks(world, time.perf_counter() - t0)

        times: dict[str, list[float]] = {"prepare": [], "library": []}
        for r in range(pairs_of(repeats, size)):
            for name, fn in (("prepare", ours), ("library", limit))[::1 if r % 2 == 0 else -1]:
                times[name].append(fn())
        docs = world.allreduce(len(mine), "sum")
        rss, training = one_rank(world, Path(tmp), size, repeats)
    out = result("data", world, size, repeats,
                 f"prepare {CORPUS_MB[size]} MiB of JSONL.zst + Parquet shards, {VOCAB}-id BPE")
    docs = int(docs)
    per_rank = docs / world.size
    out["rows"] = [row("hpctrain prepare (whole command's work)", times["prepare"], "s"),
                   row("tokenizers encode_batch of the same documents", times["library"], "s"),
                   row("prepare documents/s per rank", [per_rank / t for t in times["prepare"]],
                       "docs/s")]
    q = ratio("prepare throughput / library batch encoding", 0.0, ">= 0.8",
              pair_ratios(times["library"], times["prepare"]))
    rest = median([a - b for a, b in zip(times["prepare"], times["library"])])
    q["why"] = (f"prepare {median(times['prepare']):.2f} s against the library's "
                f"{median(times['library']):.2f} s for the same documents: {rest:.2f} s of "
                "reading, decompressing, splitting, the spill copy, the collective file and "
                f"rank 0's hash{' (more ranks than cores)' if world.size > os.cpu_count() else ''}")
    out["ratios"] = [q]
    out["check"] = {"what": "documents prepared = documents encoded",
                    "values": {"prepare": attrs.get("documents"), "library": docs},
                    "rel_err": 0.0, "tol": 0.0, "ok": attrs.get("documents") == docs}
    memory(out, rss, training)
    out["notes"].append(f"median prepare {median(times['prepare']):.2f} s for {docs} documents")
    return out
