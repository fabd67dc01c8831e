"""``hpctrain generate CKPT --prompt TEXT``: continue a prompt with a checkpoint's model.

Any layout's checkpoint works: tensors are stored in global shapes, so the whole model is
built on one process (no MPI collective) from the config saved in the checkpoint. A Hugging
Face Llama/Mixtral/Qwen-MoE directory works too, read as ``hpctrain import`` reads it. The logic
(tokenizer, key/value cache, sampling, ``--benchmark``) is ``interchange/generation.py``.
"""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="a checkpoint file, a directory with a `latest` file, "
                   "or a Hugging Face Llama/Mixtral/Qwen-MoE directory (config.json + safetensors)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: "
                   "greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0: all")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tokenizer", help="tokenizer.json (or its directory), or `bytes`; "
                   "default: the one the checkpoint's data lineage names. Either must have "
                   "the sha256 the checkpoint recorded")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole prefix for every token (no key/value cache)")
    p.add_argument("--benchmark", action="store_true",
                   help="print tokens/s with and without the cache (greedy) and the ratio")


def run(args) -> int:
    from pathlib import Path

    from ..checkpoint import latest
    from ..interchange import generation
    from ..interchange.hf_import import is_hf_directory

    path = Path(args.checkpoint)
    if path.is_dir() and not is_hf_directory(path):
        path = latest(path)
    if path is None or not (path.is_file() or is_hf_directory(path)):
        print(f"hpctrain generate: no checkpoint at {args.checkpoint}: give a checkpoint "
              "file, a directory with `latest` or a Hugging Face directory (config.json)",
              file=sys.stderr)
        return 2
    if args.tokens < 1:
        print(f"hpctrain generate: --tokens {args.tokens} must be at least 1", file=sys.stderr)
        return 2
    try:
        return generation.run(path, args.prompt, args.tokens, args.temperature, args.top_k,
                              args.seed, not args.no_cache, args.tokenizer, args.benchmark)
    except (ValueError, FileNotFoundError) as e:
        print(f"hpctrain generate: {e}", file=sys.stderr)
        return 2
