"""Is this the tokenizer the model was trained with? Every place that finds a tokenizer for a
checkpoint (``export --format hf``, ``generate``, ``checkpoint.init_from``) compares it with
the one the checkpoint recorded, and refuses a different or a missing one with one message:
the recorded hash and where it came from, each file found and its hash, and how to fix it.

What a checkpoint recorded (:func:`recorded`) is its data lineage's ``tokenizer_hash`` (the
sha256 of the tokenizer.json text, as ``Tokenizer.hash``: what ``hpctrain prepare`` stores in a
data file's attributes, what a run on the embedded corpus with ``data.tokenizer`` records, and
what ``hpctrain import`` records for a directory's tokenizer.json); ``BYTES`` for byte-level
data (also a data lineage from before tokenizers, which names none: hpctrain's own data was
byte-level then); None when the checkpoint records no tokenizer (no data lineage, or token ids
prepared without their tokenizer): then the tokenizer found or given is used unchecked, and
the note says so. A tokenizer.json that maps every id to its byte (``tokenizer.write`` exports
one for byte-level models) counts as byte-level tokens (:func:`identity`). No MPI.
"""

from __future__ import annotations

from . import tokenizer as tk
from .tokenizer import BYTES, Tokenizer, TokenizerError

FIX = "point --tokenizer at the tokenizer.json the model was trained with"


def identity(tok: Tokenizer) -> str:
    """BYTES for byte-level tokens (hpctrain's, or a 256-id tokenizer.json that encodes and
    decodes text as its UTF-8 bytes), else the sha256 of the tokenizer.json text."""
    if tok.name == BYTES:
        return BYTES
    if tok.vocab_size == 256:
        lib, raw = tok.library(), list(tk.CHECK_TEXT.encode("utf-8"))
        if lib.encode(tk.CHECK_TEXT).ids == raw and lib.decode(raw) == tk.CHECK_TEXT:
            return BYTES
    return tok.hash


def matches(tok: Tokenizer, want: str) -> bool:
    return tok.hash == want or identity(tok) == want


def pick(ids: set[str]) -> str:
    """The one of {identity, sha256} to name: byte-level when it is that."""
    return BYTES if BYTES in ids else sorted(ids)[0]


def describe(want: str) -> str:
    return "byte-level tokens (no tokenizer file)" if want == BYTES else f"sha256 {want}"


def recorded(lineage_json: str) -> tuple[str | None, str]:
    """(BYTES, a tokenizer's sha256, or None when none is recorded; where that came from),
    from a checkpoint's ``lineage`` attribute."""
    try:
        data, _ = tk.sections(lineage_json)
    except ValueError as e:
        return None, str(e)
    name, digest = str(data.get("tokenizer") or ""), str(data.get("tokenizer_hash") or "")
    if digest:
        return digest, f"the checkpoint's data lineage: tokenizer_hash of tokenizer {name}"
    if not data:
        return None, "the checkpoint records no data lineage, so no tokenizer"
    if name in ("", BYTES):
        return BYTES, "the checkpoint's data lineage: byte-level tokens"
    return None, f"the checkpoint's data lineage names tokenizer {name!r} but no hash"


def _label(source: str) -> str:
    return "the tokenizer.json inside the data file" if isinstance(source, tk.TokenizerText) \
        else str(tk.tokenizer_file(source))


def load_given(given: str) -> Tokenizer:
    """``--tokenizer``: a tokenizer.json (or its directory), or ``bytes``."""
    return tk.byte_level() if given == BYTES else tk.load(given)


def resolve(lineage_json: str, config_toml: str = "", given: str | None = None,
            fix: str = FIX) -> tuple[str | None, str]:
    """(the tokenizer to use: a path, the text a data file carries, BYTES, or None when the
    checkpoint records none and none is found; a note on where it came from and whether it
    was checked). A tokenizer that is not the recorded one, or none found for a recorded
    hash, is a TokenizerError naming both."""
    want, where = recorded(lineage_json)
    if given:
        tok = load_given(given)
        if want is None:
            return given, f"--tokenizer {given}; not checked: {where}"
        if not matches(tok, want):
            raise TokenizerError(mismatch(want, where, [f"--tokenizer {_label(given)} has "
                                                        f"{describe(identity(tok))}"], fix))
        return given, f"--tokenizer {given}, the one the checkpoint recorded"
    if want == BYTES:
        return BYTES, where
    seen = []
    try:
        named = tk.candidates(lineage_json, config_toml)
    except ValueError:
        named = []
    for source, why in named:
        if source is None:
            seen.append(f"{why} is not there")
            continue
        try:
            tok = tk.load(source)
        except TokenizerError as e:
            seen.append(str(e))
            continue
        if want is None:
            return source, f"{why}; not checked: {where}"
        if matches(tok, want):
            return source, f"{why}, the one the checkpoint recorded"
        seen.append(f"{why} has {describe(identity(tok))}")
    if want is None:
        return None, where
    raise TokenizerError(mismatch(want, where, seen or ["no tokenizer file is named"], fix))


def mismatch(want: str, where: str, seen: list[str], fix: str) -> str:
    return (f"the model was trained with the tokenizer of {describe(want)} ({where}), but "
            f"{'; '.join(seen)}: {fix}")


def of_data(path: str, tokenizer: str) -> tuple[set[str], str]:
    """What a run's data is tokenized with ({identity, sha256}: empty when unknown; what
    it is): a prepared file's recorded ``tokenizer_hash`` (byte-level when it names none), the
    ``data.tokenizer`` file for the embedded corpus, else byte-level. Reads only; a file that
    cannot be read is unknown (the data checks report it)."""
    if path:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                name, digest = (_text(f.attrs.get(k, "")) for k in
                                ("tokenizer", "tokenizer_hash"))
        except OSError:
            return set(), f"data.path={path}"
        if digest:
            return {digest}, f"data.path={path}, tokenizer_hash of tokenizer {name}"
        return ({BYTES} if name in ("", BYTES) else set()), f"data.path={path} ({name})"
    if tokenizer:
        try:
            tok = tk.load(tokenizer)
        except TokenizerError:
            return set(), f"data.tokenizer={tokenizer}"
        return {identity(tok), tok.hash}, f"data.tokenizer={tokenizer}"
    return {BYTES}, "the embedded corpus as byte-level tokens (no data.tokenizer)"


def of_hf_directory(directory) -> tuple[set[str], str]:
    """What a Hugging Face directory's tokenizer.json is ({identity, sha256}; empty without
    one, or with one the tokenizers library cannot read)."""
    from pathlib import Path

    path = Path(directory) / "tokenizer.json"
    try:
        tok = tk.load(str(path))
    except TokenizerError:
        return set(), f"{path} (absent or unreadable)"
    return {identity(tok), tok.hash}, f"{path}"


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
