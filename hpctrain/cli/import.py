"""``hpctrain import DIR --out CKPT``: a Hugging Face Llama or Mixtral directory (one or
several safetensors files) as an hpctrain checkpoint that any layout resumes or starts from
(``checkpoint.init_from``); the logic is ``interchange/hf_import.py``. One process, no MPI."""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("directory", help="Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--out", required=True,
                   help="checkpoint file (*.h5) or directory (gets step_00000000.h5 + latest)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="the model's dtype in hpctrain; auto: the HF config's")


def run(args) -> int:
    from ..interchange.hf_import import import_hf
    from ..interchange.hf_map import InterchangeError

    try:
        import_hf(args.directory, args.out, args.dtype)
    except InterchangeError as e:
        print(f"hpctrain import: {e}", file=sys.stderr)
        return 2
    return 0
