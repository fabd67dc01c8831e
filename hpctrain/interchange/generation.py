"""Text generation on one process: the whole model from a checkpoint of any layout, the
prompt encoded by the run's tokenizer (a tokenizer.json, or byte-level ids), sampling with
temperature and top-k, and a key/value cache so that each new token costs one position,
not the whole prefix (``use_cache=False`` recomputes the prefix every token, for
comparison: the same tokens, measured by :func:`benchmark`)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from ..checkpoint import integrity as cv
from ..config import dumps_toml, from_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def whole_model(m):
    """The whole model ``m`` (a ModelConfig) on one process, expert layers included (their
    token exchange the single-rank identity)."""
    from ..model import DTYPES, DecoderStage, LocalOps
    from ..model.moe import LocalExchange, MoE

    ops, exchange = LocalOps(), LocalExchange()
    resid_std = m.init_std / (2 * m.n_layers) ** 0.5

    def ffn(layer: int):
        return MoE(m, ops, exchange, DTYPES[m.dtype], resid_std) \
            if m.moe_layer(layer) else None

    return DecoderStage(m, range(m.n_layers), first=True, last=True, ops=ops, ffn_factory=ffn)


def load_model(path):
    """(model on one process, config, (the checkpoint's lineage JSON, its config TOML)) of a
    checkpoint, or of a Hugging Face directory read as ``import`` reads it."""
    import h5py

    from . import hf_import

    if hf_import.is_hf_directory(path):
        _, cfg, tensors, lineage = hf_import.read_hf(path)
        model = _filled(whole_model(cfg.model), tensors.__getitem__)
        return model, cfg, (json.dumps(lineage), dumps_toml(cfg))
    with h5py.File(path, "r") as f:
        cfg = from_dict(tomllib.loads(str(cv._plain(f.attrs["config"]))))
        model = _filled(whole_model(cfg.model), lambda name: f[f"model/{name}"][...])
        lineage = (str(cv._plain(f.attrs.get("lineage", ""))), str(cv._plain(f.attrs["config"])))
    return model, cfg, lineage


def _filled(model, read):
    """``model`` in eval mode with every parameter (and MoE selection bias) copied from
    ``read(name)`` (numpy)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(read(name)).to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith(".route_bias"):  # an MoE layer's selection bias (routing state)
                b.copy_(torch.from_numpy(read(name)).to(b.dtype))
    return model.eval()


class Codec:
    """Text <-> ids: a ``tokenizers.Tokenizer``, or bytes when ``tok`` is None."""

    def __init__(self, tok=None, what: str = "byte-level (id = byte)"):
        self.tok, self.what = tok, what

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids if self.tok else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tok:
            return self.tok.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def codec_for(tokenizer_arg: str | None, lineage: tuple[str, str]) -> Codec:
    """``--tokenizer``, else what the checkpoint's data used, checked against the hash the
    checkpoint recorded (``data.tokenizer_match``); byte-level ids only for byte-level data or
    ``--tokenizer bytes``. A checkpoint that records no tokenizer and names no file is
    refused rather than decoded as bytes."""
    from ..data import tokenizer, tokenizer_match

    source, why = tokenizer_match.resolve(*lineage, given=tokenizer_arg)
    if source is None:
        raise ValueError(f"no tokenizer for this checkpoint ({why}): give the one it was "
                         f"trained with, --tokenizer tokenizer.json, or --tokenizer bytes for "
                         f"byte-level ids")
    if source == tokenizer.BYTES:
        return Codec()
    tok = tokenizer_match.load_given(source)
    where = ("inside the data file" if isinstance(source, tokenizer.TokenizerText)
             else source)
    return Codec(tok.library(), f"tokenizer {where} ({tok.vocab_size} ids)")


def next_token(logits, temperature: float, top_k: int, g):
    """(B, V) logits of the last position -> (B, 1) ids."""
    import torch

    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.double() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=g)


def generate(model, prompt: list[int], tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, use_cache: bool = True) -> list[int]:
    """The ids generated after ``prompt``. With the cache the prompt is run once and every
    further call sees only the newest token; without it, the whole sequence every time."""
    import torch

    from ..model import KVCache

    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt])
    cache = KVCache() if use_cache else None
    feed = idx
    with torch.no_grad():
        for _ in range(tokens):
            logits = model.logits(feed, cache=cache) if use_cache else model.logits(idx)
            nxt = next_token(logits[:, -1, :V], temperature, top_k, g)
            idx = torch.cat([idx, nxt], dim=1)
            feed = nxt
    return idx[0, len(prompt):].tolist()


def benchmark(model, prompt: list[int], tokens: int, repeats: int = 3, say=print) -> dict:
    """Tokens/s with and without the cache (greedy, interleaved A/B runs): median, spread,
    the ratio and the load average; the two must produce the same tokens."""
    times: dict[bool, list[float]] = {True: [], False: []}
    out: dict[bool, list[int]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(repeats):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            out[use_cache] = generate(model, prompt, tokens, 0.0, 0, 0, use_cache)
            times[use_cache].append(time.perf_counter() - t0)
    rate = {k: [tokens / t for t in v] for k, v in times.items()}
    res = {"tokens": tokens, "prompt": len(prompt), "repeats": repeats,
           "cache_tok_s": statistics.median(rate[True]),
           "no_cache_tok_s": statistics.median(rate[False]),
           "cache_spread": max(rate[True]) - min(rate[True]),
           "no_cache_spread": max(rate[False]) - min(rate[False]),
           "same_tokens": out[True] == out[False],
           "load_avg": (load0, os.getloadavg()[0])}
    res["ratio"] = res["cache_tok_s"] / res["no_cache_tok_s"]
    say(f"generate {tokens} tokens after a {len(prompt)}-token prompt, greedy, {repeats} "
        f"interleaved runs each: with cache {res['cache_tok_s']:.1f} tok/s (spread "
        f"{res['cache_spread']:.1f}), without {res['no_cache_tok_s']:.1f} tok/s (spread "
        f"{res['no_cache_spread']:.1f}): {res['ratio']:.2f}x; same tokens: "
        f"{res['same_tokens']}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return res


def run(path: Path, prompt_text: str, tokens: int, temperature: float, top_k: int, seed: int,
        use_cache: bool, tokenizer_arg: str | None, bench: bool, say=print) -> int:
    model, cfg, lineage = load_model(path)
    codec = codec_for(tokenizer_arg, lineage)
    prompt = codec.encode(prompt_text) or [10]
    if max(prompt) >= cfg.model.vocab_size:
        raise ValueError(f"the prompt has ids outside the model's vocabulary of "
                         f"{cfg.model.vocab_size} ({codec.what})")
    if bench:
        benchmark(model, prompt, tokens, say=say)
        return 0
    ids = generate(model, prompt, tokens, temperature, top_k, seed, use_cache)
    say(prompt_text + codec.decode(ids))
    return 0
