"""``hpctrain prepare [SOURCES...] --out DATA.h5 [--tokenizer tokenizer.json]`` (text files,
JSONL and Parquet shards, directories and globs of them) and
``hpctrain prepare --from nanogpt|megatron PATH --out DATA.h5``: a token dataset (HDF5) with
a held-out split chosen by document content. Runs on one process or on every rank under
mpirun/srun (ranks tokenize disjoint documents and write one file together; the file is the
same for any number of ranks). Layout and attributes: docs/data.md."""

from __future__ import annotations


def add_arguments(p) -> None:
    from ..data.corpora import FORMATS

    p.add_argument("sources", nargs="*", help="files, directories or globs (quoted): "
                   ".jsonl/.json (also .gz, .zst) and .parquet shards by their suffix, any "
                   "other file one text document (default: the embedded corpus, Python's "
                   "own standard-library sources); with --from: the nanoGPT .bin file or "
                   "the Megatron PREFIX (of PREFIX.bin/.idx)")
    p.add_argument("--out", required=True, help="dataset file to write")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (any Hugging Face "
                   "tokenizer; `hpctrain tokenizer train` makes one); default: byte-level. "
                   "With --from it is only recorded (the ids are not re-tokenized)")
    p.add_argument("--hidden", action="store_true", help="also read hidden files and "
                   "directories below a directory (names starting with '.', e.g. .git/)")
    p.add_argument("--binary", action="store_true", help="also read binary files (a NUL "
                   "byte or an executable, archive or image signature at the start), e.g. "
                   "for byte-level models of any data")
    p.add_argument("--from", dest="form", choices=FORMATS, default=None,
                   help="read an already tokenized corpus instead of text (default: none, "
                        "the sources are text)")
    p.add_argument("--eot", type=int, default=None, help="end-of-text id that ends each "
                   "document of a --from nanogpt file (default: the file's: GPT-2's 50256 for "
                   "uint16 ids, 128000 for llm.c's Llama-3 files)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of documents held out for validation (by content hash)")
    p.add_argument("--corpus-mb", type=float, default=2.0,
                   help="size of the embedded corpus when no sources are given")
    bad = ("skip and count records that are not documents (bad JSON or UTF-8, the field "
           "missing or not a string, a Parquet file without the column) instead of refusing")
    p.add_argument("--skip-bad-records", action="store_true", help=bad)
    p.add_argument("--text-key", default="text",
                   help="the JSON field or Parquet column holding each document's text")


def problems(args) -> str | None:
    if not 0 <= args.val_fraction < 1 or not 0 < args.corpus_mb < float("inf"):
        return (f"--val-fraction={args.val_fraction} must be in [0, 1) and "
                f"--corpus-mb={args.corpus_mb} > 0")
    if args.form and len(args.sources) != 1:
        return (f"--from {args.form} reads one corpus (a .bin file or a Megatron prefix), "
                f"got {len(args.sources)}")
    if args.eot is not None and not 0 <= args.eot < 2**32:
        return f"--eot={args.eot} must be a token id in [0, 2**32)"
    return None


def run(args) -> int:
    from .. import comm
    from ..data.dataset import DataError
    from ..data.prepare import embedded_source, prepare, text_source, token_source
    from ..data.tokenizer import TokenizerError, byte_level, load
    from . import refused

    world = comm.world()
    comm.abort_on_exception(world)  # a rank's uncaught exception ends the job
    bad = problems(args)
    try:
        if bad:
            raise DataError(bad)
        tok = load(args.tokenizer) if args.tokenizer else None
        if args.form:
            src = token_source(args.form, args.sources[0], args.eot)
        else:
            src = (text_source(args.sources, args.hidden, args.binary, args.text_key,
                               group=world)
                   if args.sources else embedded_source(args.corpus_mb))
            tok = tok or byte_level()
        attrs = prepare(src, tok, args.out, args.val_fraction, world, args.skip_bad_records)
    except (DataError, TokenizerError) as e:  # the same verdict on every rank
        return refused(world, "prepare", e)
    if world.rank == 0:
        print("\n".join(summary(args.out, attrs)), flush=True)
    return 0


SHOWN = 20  # inputs listed one per line in the summary


def summary(out: str, attrs: dict) -> list[str]:
    """What ``prepare`` says when it has written ``out``: totals, per input when there are
    several, and what was skipped."""
    import json

    lines = [f"wrote {out}: {attrs['documents']} documents ({attrs['val_documents']} held "
             f"out), {attrs['train_tokens'] + attrs['val_tokens']} tokens "
             f"({attrs['val_tokens']} held out), largest token id {attrs['max_token_id']} "
             f"(tokenizer {attrs['tokenizer']}, vocabulary {attrs['vocab_size']}), hash "
             f"{attrs['content_hash'][:16]}"]
    per_source = json.loads(attrs["source_counts"])
    if len(per_source) > 1:
        lines += [f"  {s['source']}: {s['train_documents']} + {s['val_documents']} documents, "
                  f"{s['train_tokens']} + {s['val_tokens']} tokens (train + val)"
                  for s in per_source[:SHOWN]]
        if len(per_source) > SHOWN:
            lines.append(f"  ... {len(per_source) - SHOWN} more inputs (hpctrain inspect "
                         f"{out} --json lists them)")
    if attrs.get("skipped_hidden") or attrs.get("skipped_binary"):
        lines.append(f"skipped {attrs['skipped_hidden']} hidden files or directories (a name "
                     f"starting with '.'; --hidden reads them) and "
                     f"{attrs['skipped_binary']} binary files (a NUL byte or an executable, "
                     "archive or image signature at the start; --binary reads them)")
    if attrs.get("skipped_records") or attrs.get("skipped_files"):
        lines.append(f"skipped {attrs['skipped_records']} bad records and "
                     f"{attrs['skipped_files']} files without the text column "
                     "(--skip-bad-records)")
    return lines
