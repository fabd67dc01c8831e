"""Tokenizers: byte-level tokens, or any Hugging Face ``tokenizer.json`` (BPE, WordPiece,
Unigram, a user's Llama or GPT-2 file); training a byte-level BPE on documents; which
tokenizer belongs to a checkpoint or a data file, and writing it next to an exported model.

No MPI, imports nothing of hpctrain. A tokenizer is known by the sha256 of its JSON text
(``Tokenizer.hash``), its vocabulary size (added tokens included) and the token dtype that
follows from it (:func:`token_dtype`: uint16 up to 65536 ids, else uint32; byte-level tokens
stay uint8). Encoding is deterministic: the same documents give the same ids in any process.

Documents are bytes; a tokenizer reads them as UTF-8 (an invalid byte becomes U+FFFD) and adds
its own special tokens (a Llama file's ``<s>``; the BPE trained here opens each document with
``<|endoftext|>``, id 0).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BYTES = "bytes"  # byte-level: token = byte value, vocabulary 256
EOT = "<|endoftext|>"
LINEAGE_KEYS = ("tokenizer_json", "tokenizer_path", "tokenizer_file")
CHECK_TEXT = "def f(x):\n\treturn x ** 2  # héllo wörld ✓ 日本語 \x00\x7f"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: one line naming the file and what is wrong."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass(frozen=True)
class Tokenizer:
    """One tokenizer: ``name`` (``bytes`` or ``hf:<model>:<hash prefix>``), ``json`` (the
    tokenizer.json text; "" for bytes), ``hash`` (sha256 of that text), ``vocab_size``."""

    name: str
    json: str
    hash: str
    vocab_size: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.name == BYTES else token_dtype(self.vocab_size)

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        """The token ids of each document, in this tokenizer's dtype."""
        if self.name == BYTES:
            return [np.frombuffer(d, dtype=np.uint8).copy() for d in docs]
        enc = _hf(self.json).encode_batch([d.decode("utf-8", errors="replace") for d in docs],
                                          add_special_tokens=True)
        return [np.asarray(e.ids, dtype=self.dtype) for e in enc]

    def library(self):
        """This tokenizer as a ``tokenizers.Tokenizer`` (for text in and out, and for saving
        a tokenizer.json). Byte-level: one whose id i is byte i, or None when the library
        cannot express that exactly (checked on all 256 ids and a mixed-script text)."""
        return _byte_level_library() if self.name == BYTES else _hf(self.json)


def byte_level() -> Tokenizer:
    """hpctrain's own vocabulary: token id = byte value, 256 ids."""
    return Tokenizer(BYTES, "", "", 256)


def from_json(text: str, where: str) -> Tokenizer:
    """A tokenizer from its JSON text (``where`` names it in errors)."""
    try:
        tok = _hf(text)
    except Exception as e:  # the library raises plain Exception subclasses of its own
        raise TokenizerError(f"{where} is not a tokenizer.json the tokenizers library can "
                             f"load: {' '.join(str(e).split())[:300]}") from None
    digest = hashlib.sha256(text.encode()).hexdigest()
    kind = type(tok.model).__name__
    return Tokenizer(f"hf:{kind}:{digest[:12]}", text, digest,
                     int(tok.get_vocab_size(with_added_tokens=True)))


class TokenizerText(str):
    """A tokenizer.json's text (carried inside a prepared data file) rather than a path."""


def load(path: str) -> Tokenizer:
    """The tokenizer ``path`` names: a tokenizer.json file, a directory holding one, or the
    text of one (:class:`TokenizerText`, as :func:`find` returns it). A missing, unreadable or
    foreign file is a TokenizerError."""
    if isinstance(path, TokenizerText):
        return from_json(str(path), "the tokenizer.json inside the data file")
    p = tokenizer_file(path)
    if not p.is_file():
        why = ("is not a file (nor a directory holding tokenizer.json)" if p.exists()
               else "does not exist")
        raise TokenizerError(f"tokenizer {path} {why} (make one with `hpctrain tokenizer "
                             "train FILES --vocab-size N --out tokenizer.json`)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer {path} cannot be read: {e}") from None
    return from_json(text, f"tokenizer {path}")


def train_bpe(docs: list[bytes], vocab_size: int) -> str:
    """A byte-level BPE (GPT-2 style pre-tokenizer and decoder, ``<|endoftext|>`` id 0 opening
    each document, as a beginning-of-sequence token: documents stay separated in the token
    stream, and a prompt encoded by any library starts the way training documents do, rather
    than ending in an end-of-text) trained on ``docs``; returns its tokenizer.json text.
    Deterministic."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([d.decode("utf-8", errors="replace") for d in docs], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", special_tokens=[(EOT, tok.token_to_id(EOT))])
    return tok.to_str(pretty=True)


def tokenizer_file(path: str) -> Path:
    """A tokenizer.json path given as the file or as the directory holding it."""
    p = Path(path)
    return p / "tokenizer.json" if (p / "tokenizer.json").is_file() else p


def tokenizer_json(path: str) -> str | None:
    """The tokenizer.json text a prepared data file carries (dataset ``/tokenizer_json``), or
    None (byte-level tokens, or a file from before tokenizers). A file that cannot be read
    as one is a TokenizerError."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            d = f.get("tokenizer_json")
            return None if d is None else d[...].tobytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: no readable tokenizer.json inside: "
                             f"{' '.join(str(e).split())[:300]}") from None


def sections(lineage_json: str, config_toml: str = "") -> tuple[dict, dict]:
    """(the data lineage, the config's ``[data]``) of a checkpoint's ``lineage`` and
    ``config`` attributes; ValueError when either cannot be read."""
    try:
        lineage = json.loads(lineage_json or "{}")
        section = tomllib.loads(config_toml or "").get("data", {})
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"the checkpoint's lineage is unreadable ({e})") from None
    data = lineage.get("data", {}) if isinstance(lineage, dict) else {}
    return (data if isinstance(data, dict) else {}), section


def candidates(lineage_json: str, config_toml: str = "") -> list[tuple[str | None, str]]:
    """Every tokenizer a checkpoint's lineage and config name, in the order :func:`find`
    tries them: (a tokenizer.json path, or the text a prepared data file carries, a blend's
    sources included; None when the named file is not there), where it was named."""
    data, section = sections(lineage_json, config_toml)
    out: list[tuple[str | None, str]] = []
    for key, value in [(f"data lineage {k}", data.get(k)) for k in LINEAGE_KEYS] \
            + [("data.tokenizer", section.get("tokenizer"))]:
        if value:
            out.append((str(value) if Path(str(value)).is_file() else None, f"{key} {value}"))
    blend = [s.get("path") for s in section.get("sources", []) if isinstance(s, dict)]
    for where in dict.fromkeys(str(w) for w in (data.get("source"), section.get("path"), *blend)
                               if w):
        if Path(where).is_file():
            text = _carried(where)
            if text is not None:
                out.append((text, f"the tokenizer.json inside {where}"))
        elif not where.startswith("embedded"):
            out.append((None, f"the data file {where}"))
    return out


def find(lineage_json: str, config_toml: str = "") -> tuple[str | None, str]:
    """(a tokenizer.json path, its text, BYTES, or None; where it came from), from a
    checkpoint's ``lineage`` and ``config`` attributes: a tokenizer file the data lineage
    names, ``data.tokenizer``, the tokenizer.json a prepared data file carries, or the
    byte-level vocabulary of hpctrain's own data. Unchecked: ``tokenizer_match.resolve``
    also compares the hash the lineage recorded."""
    try:
        data, section = sections(lineage_json, config_toml)
        found = [(s, why) for s, why in candidates(lineage_json, config_toml) if s is not None]
    except ValueError:
        return None, "the checkpoint's lineage is unreadable"
    if found:
        return found[0]
    if data.get("tokenizer") == BYTES or (data and not section.get("tokenizer")
                                          and not data.get("tokenizer")):
        return BYTES, "data lineage: byte-level tokens"
    if not data:
        return None, "the checkpoint records no data lineage"
    return None, f"the data lineage names tokenizer {data.get('tokenizer')!r} but no file"


def special_ids(lib) -> dict:
    """bos/eos ids of a library tokenizer that has such tokens."""
    out = {}
    for kind, names in (("bos", ("<s>", "<|begin_of_text|>", "<bos>")),
                        ("eos", ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"))):
        for name in names:
            i = lib.token_to_id(name)
            if i is not None:
                out[kind] = int(i)
                break
    return out


def write(out: Path, source: str | None, vocab_size: int, max_len: int) -> tuple[dict, str]:
    """Write tokenizer.json (a file's text as it is) + tokenizer_config.json into ``out`` for
    the tokenizer ``source`` names (as :func:`load` reads it); returns (bos/eos ids, a note
    saying what was written or why nothing was)."""
    if source is None:
        return {}, "no tokenizer written (none given with --tokenizer, none in the lineage)"
    tok = byte_level() if source == BYTES else load(source)
    lib = tok.library()
    cfg_src = None
    if source == BYTES:
        if lib is None or vocab_size != 256:
            return {}, (f"no tokenizer written: byte-level vocabulary of {vocab_size} ids "
                        f"cannot be expressed exactly")
        what = "byte-level tokenizer (id = byte value)"
    elif isinstance(source, TokenizerText):
        what = "the tokenizer inside the data file"
    else:
        src = tokenizer_file(source)
        what, cfg_src = f"tokenizer from {src}", src.parent / "tokenizer_config.json"
    if source == BYTES:
        lib.save(str(out / "tokenizer.json"))
    else:  # the text itself, so that its sha256 stays the one the lineage records
        (out / "tokenizer.json").write_text(tok.json, encoding="utf-8")
    ids = special_ids(lib)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    if cfg_src is not None and cfg_src.is_file():
        config = {**json.loads(cfg_src.read_text()), "model_max_length": max_len}
    for kind in ("bos", "eos"):
        if kind in ids:
            config[f"{kind}_token"] = lib.id_to_token(ids[kind])
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids, f"wrote {what}"


def _carried(path: str) -> TokenizerText | None:
    """The tokenizer.json a prepared data file carries, when it has one and can be read."""
    try:
        text = tokenizer_json(path)
    except TokenizerError:
        return None
    return None if text is None else TokenizerText(text)


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


def _byte_level_library():
    """A ``tokenizers.Tokenizer`` whose id i is byte i, or None (see Tokenizer.library)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = HF(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    ok = all(tok.id_to_token(b) == table[b] for b in range(256))
    ok = ok and tok.encode(CHECK_TEXT).ids == list(CHECK_TEXT.encode("utf-8"))
    ok = ok and tok.decode(list(CHECK_TEXT.encode("utf-8"))) == CHECK_TEXT
    return tok if ok else None


@functools.lru_cache(maxsize=2)
def _hf(text: str):
    """The library's tokenizer for a JSON text (parsed once per process and text)."""
    from tokenizers import Tokenizer as HF

    return HF.from_str(text)
