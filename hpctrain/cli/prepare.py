"""``hpctrain prepare TEXT... --out DATA.h5`` (byte-level tokens, held-out split by document)"""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("sources", nargs="*", help="text files or directories (default: the "
                   "embedded corpus, Python's own standard-library sources)")
    p.add_argument("--out", required=True, help="dataset file to write")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of documents held out for validation (by content hash)")
    p.add_argument("--corpus-mb", type=float, default=2.0,
                   help="size of the embedded corpus when no sources are given")


def run(args) -> int:
    import tempfile
    from pathlib import Path

    from ..data import DataError, prepare, stdlib_documents

    if not 0 <= args.val_fraction < 1 or not 0 < args.corpus_mb < float("inf"):
        print(f"hpctrain prepare: --val-fraction={args.val_fraction} must be in [0, 1) and "
              f"--corpus-mb={args.corpus_mb} > 0", file=sys.stderr)
        return 2
    sources = args.sources
    with tempfile.TemporaryDirectory() as tmp:
        if not sources:  # the embedded corpus, written out as documents
            for i, (name, data) in enumerate(stdlib_documents(int(args.corpus_mb * 2**20))):
                (Path(tmp) / f"{i:05d}_{name.replace('/', '_')}").write_bytes(data)
            sources = [tmp]
        try:
            attrs = prepare(sources, args.out, args.val_fraction)
        except DataError as e:
            print(f"hpctrain prepare: {e}", file=sys.stderr)
            return 2
    print(f"wrote {args.out}: {attrs['documents']} documents, largest token id "
          f"{attrs['max_token_id']} (tokenizer {attrs['tokenizer']}), "
          f"hash {attrs['content_hash'][:16]}")
    return 0
