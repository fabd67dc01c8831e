"""``hpctrain tokenizer train FILES... --vocab-size N --out tokenizer.json`` (or ``--embedded``):
a byte-level BPE trained with the Hugging Face ``tokenizers`` library, offline and
deterministic (the same documents give the same file)."""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("train", help="train a byte-level BPE on text files",
                       description="train a byte-level BPE on text files (or the embedded "
                       "corpus) and write its tokenizer.json")
    t.add_argument("sources", nargs="*", help="text files or directories")
    t.add_argument("--embedded", action="store_true", help="train on the embedded corpus "
                   "(Python's own standard-library sources) instead of files")
    t.add_argument("--corpus-mb", type=float, default=2.0,
                   help="size of the embedded corpus (with --embedded)")
    t.add_argument("--vocab-size", type=int, required=True,
                   help="vocabulary size: 256 bytes + <|endoftext|> + merges (>= 257)")
    t.add_argument("--out", required=True, help="tokenizer.json to write")


def run(args) -> int:
    from pathlib import Path

    from ..data.dataset import DataError
    from ..data.prepare import binary, embedded_source, text_source
    from ..data.tokenizer import train_bpe

    bad = problems(args)
    if bad:
        print(f"hpctrain tokenizer: {bad}", file=sys.stderr)
        return 2
    try:
        src = (embedded_source(args.corpus_mb) if args.embedded
               else text_source(args.sources, binary=True))  # binary files: counted below
        docs = [d for i in range(len(src.names)) for d in src.texts(i)]
    except DataError as e:
        print(f"hpctrain tokenizer: {e}", file=sys.stderr)
        return 2
    if not args.embedded:  # as prepare: binary files are not documents
        kept = [d for d in docs if not binary(d)]
        if len(kept) < len(docs) or src.hidden:
            print(f"skipped {len(docs) - len(kept)} binary files, {src.hidden} hidden entries")
        docs = kept
    if not docs:
        print("hpctrain tokenizer: no text documents (every file is binary)", file=sys.stderr)
        return 2
    text = train_bpe(docs, args.vocab_size)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        if tmp.is_file():
            tmp.unlink()
        print(f"hpctrain tokenizer: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    from ..data.tokenizer import from_json

    tok = from_json(text, args.out)
    short = (f" (asked {args.vocab_size}: the documents hold no more merges)"
             if tok.vocab_size < args.vocab_size else "")
    print(f"wrote {args.out}: byte-level BPE, vocabulary {tok.vocab_size}{short} from "
          f"{len(docs)} documents, hash {tok.hash[:16]}")
    return 0


def problems(args) -> str | None:
    """What is wrong with the arguments, in one line (None when nothing)."""
    if args.embedded == bool(args.sources):
        return "give text FILES or --embedded (one of the two)"
    if not 257 <= args.vocab_size <= 2**32:
        return (f"--vocab-size={args.vocab_size} must be at least 257 (256 bytes and "
                "<|endoftext|>) and at most 2**32")
    if not 0 < args.corpus_mb < float("inf"):
        return f"--corpus-mb={args.corpus_mb} must be > 0"
    return None
