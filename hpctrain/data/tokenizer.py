"""Tokenizers: byte-level tokens, or any Hugging Face ``tokenizer.json`` (BPE, WordPiece,
Unigram, a user's Llama or GPT-2 file), and training a byte-level BPE on documents.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTES = "bytes"  # byte-level: token = byte value, vocabulary 256
EOT = "<|endoftext|>"


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


def byte_level() -> Tokenizer:
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


def load(path: str) -> Tokenizer:
    """A tokenizer.json file; a missing, unreadable or foreign file is a TokenizerError."""
    p = Path(path)
    if not p.is_file():
        why = "is not a file" if p.exists() else "does not exist"
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


@functools.lru_cache(maxsize=2)
def _hf(text: str):
    """The library's tokenizer for a JSON text (parsed once per process and text)."""
    from tokenizers import Tokenizer as HF

    return HF.from_str(text)
