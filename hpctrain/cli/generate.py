"""``hpctrain generate CKPT --prompt TEXT``: continue a prompt with a checkpoint's model.

Any layout's checkpoint works: tensors are stored in global shapes, so the whole model is
built on one process (no MPI collective) from the config saved in the checkpoint.
"""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="a checkpoint file, or a directory with a `latest` file")
    p.add_argument("--prompt", default="def ", help="text to continue (byte-level tokens)")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0)


def load_model(path):
    """(model on one process, config) from a checkpoint of any layout."""
    import h5py
    import torch

    from ..config import from_dict
    from ..model import GPTStage

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with h5py.File(path, "r") as f:
        cfg = from_dict(tomllib.loads(str(f.attrs["config"])))
        model = GPTStage(cfg.model, range(cfg.model.n_layers), first=True, last=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(f[f"model/{name}"][...]).to(p.dtype))
    return model.eval(), cfg


def run(args) -> int:
    from pathlib import Path

    import torch

    from ..checkpoint import latest

    path = Path(args.checkpoint)
    if path.is_dir():
        path = latest(path)
    if path is None or not path.is_file():
        print(f"hpctrain generate: no checkpoint at {args.checkpoint}", file=sys.stderr)
        return 2
    model, cfg = load_model(path)
    prompt = list(args.prompt.encode("utf-8")) or [10]
    if max(prompt) >= cfg.model.vocab_size:
        print("hpctrain generate: the prompt has bytes outside the model's vocabulary",
              file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(args.tokens):
            logits = model.logits(idx[:, -cfg.train.seq_len:])[:, -1, :cfg.model.vocab_size]
            if args.temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits.double() / args.temperature
                if args.top_k:
                    kth = logits.topk(min(args.top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
            idx = torch.cat([idx, nxt], dim=1)
    text = bytes(idx[0, len(prompt):].tolist()).decode("utf-8", errors="replace")
    print(args.prompt + text)
    return 0
