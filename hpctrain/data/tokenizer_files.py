"""Tokenizers for export and generation: a ``tokenizer.json`` given by the user or named by
the checkpoint's data lineage, or hpctrain's byte-level vocabulary (token id = byte value,
256 ids) rebuilt with the ``tokenizers`` library and checked to map ids 0..255 to the raw
bytes exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .dataset import DataError, tokenizer_json
from .tokenizer import BYTES  # the byte-level vocabulary (token id = byte value)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LINEAGE_KEYS = ("tokenizer_json", "tokenizer_path", "tokenizer_file")
CHECK_TEXT = "def f(x):\n\treturn x ** 2  # héllo wörld ✓ 日本語 \x00\x7f"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def byte_level():
    """A ``tokenizers.Tokenizer`` whose id i is byte i, or None when the library cannot
    express that exactly (checked on all 256 ids and a mixed-script text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    ok = all(tok.id_to_token(b) == table[b] for b in range(256))
    ok = ok and tok.encode(CHECK_TEXT).ids == list(CHECK_TEXT.encode("utf-8"))
    ok = ok and tok.decode(list(CHECK_TEXT.encode("utf-8"))) == CHECK_TEXT
    return tok if ok else None


class TokenizerText(str):
    """A tokenizer.json's text (carried inside a prepared data file) rather than a path."""


def _from_data_file(path: str) -> TokenizerText | None:
    """The tokenizer.json a prepared data file carries (:func:`.dataset.tokenizer_json`),
    when it has one and can be read."""
    try:
        text = tokenizer_json(path)
    except (DataError, ValueError):  # unreadable file or dataset; text not UTF-8
        return None
    return None if text is None else TokenizerText(text)


def find(lineage_json: str, config_toml: str = "") -> tuple[str | None, str]:
    """(a tokenizer.json path, its text, BYTES, or None; where it came from), from a
    checkpoint's ``lineage`` and ``config`` attributes: a tokenizer file the data lineage
    names, the tokenizer.json a prepared data file carries, ``data.tokenizer``, or the
    byte-level vocabulary of hpctrain's own data."""
    try:
        data = json.loads(lineage_json or "{}").get("data", {})
        section = tomllib.loads(config_toml or "").get("data", {})
    except (ValueError, AttributeError, tomllib.TOMLDecodeError):
        return None, "the checkpoint's lineage is unreadable"
    for key in LINEAGE_KEYS:
        value = data.get(key)
        if value and Path(str(value)).is_file():
            return str(value), f"data lineage {key}"
    for where in (data.get("source"), section.get("path")):
        if where and Path(str(where)).is_file():
            text = _from_data_file(str(where))
            if text is not None:
                return text, f"the tokenizer.json inside {where}"
    if section.get("tokenizer") and Path(section["tokenizer"]).is_file():
        return str(section["tokenizer"]), "data.tokenizer"
    if data.get("tokenizer") == BYTES or (data and not section.get("tokenizer")
                                          and not data.get("tokenizer")):
        return BYTES, "data lineage: byte-level tokens"
    if not data:
        return None, "the checkpoint records no data lineage"
    return None, f"the data lineage names tokenizer {data.get('tokenizer')!r} but no file"


def from_text_or_file(source: str):
    from tokenizers import Tokenizer

    if isinstance(source, TokenizerText):
        return Tokenizer.from_str(str(source))
    return Tokenizer.from_file(str(tokenizer_file(source)))


def tokenizer_file(path: str) -> Path:
    """``--tokenizer PATH``: a tokenizer.json, or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there")
    return p


def load(source: str | None, vocab_size: int):
    """(tokenizers.Tokenizer, description) for generation; ``source`` a tokenizer.json path,
    BYTES or None (byte-level, as before: hpctrain's own data is byte-level)."""
    if source and source != BYTES:
        tok = from_text_or_file(source)
        where = "inside the data file" if isinstance(source, TokenizerText) else source
        return tok, f"tokenizer {where} ({tok.get_vocab_size()} ids)"
    tok = byte_level() if vocab_size >= 256 else None
    return tok, "byte-level (id = byte)"


def special_ids(tok) -> dict:
    """bos/eos ids of a tokenizer that has such tokens."""
    out = {}
    for kind, names in (("bos", ("<s>", "<|begin_of_text|>", "<bos>")),
                        ("eos", ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"))):
        for name in names:
            i = tok.token_to_id(name)
            if i is not None:
                out[kind] = int(i)
                break
    return out


def write(out: Path, source: str | None, vocab_size: int, max_len: int) -> tuple[dict, str]:
    """Write tokenizer.json + tokenizer_config.json into ``out``; returns (bos/eos ids, a
    note saying what was written or why nothing was)."""
    if source is None:
        return {}, "no tokenizer written (none given with --tokenizer, none in the lineage)"
    if source == BYTES:
        tok = byte_level()
        if tok is None or vocab_size != 256:
            return {}, (f"no tokenizer written: byte-level vocabulary of {vocab_size} ids "
                        f"cannot be expressed exactly")
        what = "byte-level tokenizer (id = byte value)"
    else:
        tok = from_text_or_file(source)
        text = isinstance(source, TokenizerText)
        src = None if text else tokenizer_file(source)
        what = "the tokenizer inside the data file" if text else f"tokenizer from {src}"
        cfg_src = Path("/nonexistent") if text else src.parent / "tokenizer_config.json"
    tok.save(str(out / "tokenizer.json"))
    ids = special_ids(tok)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    if source != BYTES and cfg_src.is_file():
        config = {**json.loads(cfg_src.read_text()), "model_max_length": max_len}
    for kind in ("bos", "eos"):
        if kind in ids:
            config[f"{kind}_token"] = tok.id_to_token(ids[kind])
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids, f"wrote {what}"
