"""The checkpoint formats hpctrain converts, one :class:`Format` line each in
:data:`FORMATS`: how a source in it is recognised, the function that imports it as an
hpctrain checkpoint, the one that exports a checkpoint to it, and whether
``checkpoint.init_from`` starts a run from it directly. ``hpctrain import`` and ``hpctrain
export`` take their ``--format`` choices and their dispatch from here, ``init_from`` its source
kinds, and docs/interchange.md its table of formats (:func:`markdown`). Adding a format is
a module with its reader and writer and one line here (docs/design.md, "A checkpoint
format"). Each format's functions import their modules when called, so the CLI's help needs
neither torch nor h5py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import InterchangeError


def _is_hf(path: Path) -> bool:
    from .hf_import import is_hf_directory

    return is_hf_directory(path)


def _is_dcp(path: Path) -> bool:
    from .dcp import is_dcp_directory

    return path.is_dir() and is_dcp_directory(path)


@dataclass(frozen=True)
class Options:
    """What the user asked of a conversion: ``cfg`` (a Config, from ``--config``), ``dtype``,
    ``verify`` (the checkpoint's checksums first), Hugging Face's ``max_shard_size`` and
    ``tokenizer``."""

    cfg: object = None
    dtype: str = "auto"
    verify: bool = True
    max_shard_size: str = "5GB"
    tokenizer: str | None = None


def _hf_in(source: Path, out: Path, o: Options, say) -> Path:
    from .hf_import import import_hf

    return import_hf(source, out, o.dtype, say)


def _hf_out(checkpoint: Path, out: str, o: Options, say) -> Path:
    from .hf_export import export_hf

    return export_hf(checkpoint, Path(out), o.dtype, o.max_shard_size, o.tokenizer, say)


def _dcp_in(source: Path, out: Path, o: Options, say) -> Path:
    from .trainers import import_dcp

    return import_dcp(source, out, o.cfg, say)


def _dcp_out(checkpoint: Path, out: str, o: Options, say) -> Path:
    from .trainers import export_dcp

    if Path(out).exists() and not Path(out).is_dir():
        raise InterchangeError(f"{out} is a file: --format dcp writes a directory; give --out "
                               f"a new directory")
    export_dcp(checkpoint, Path(out), o.dtype, o.verify, say)
    return Path(out)


def _safetensors_out(checkpoint: Path, out: str, o: Options, say) -> Path:
    from .hf_export import export_safetensors, safetensors_path

    return export_safetensors(checkpoint, safetensors_path(out), o.verify, say)


@dataclass(frozen=True)
class Format:
    """One format: ``reads`` imports a source in it (``f(source, out, options, say)``),
    ``writes`` exports a checkpoint to it (``f(checkpoint, out, options, say)``); None: not
    that direction. ``needs_config``: the format does not describe its model, so import needs
    ``--config``; ``init_from``: a run starts from it directly."""

    name: str
    what: str
    detect: Callable[[Path], bool] | None
    reads: Callable | None
    writes: Callable | None
    init_from: bool
    needs_config: bool
    carries: str
    refuses: str


FORMATS = (
    Format("hf", "a Hugging Face model directory (config.json, safetensors shards)", _is_hf,
           _hf_in, _hf_out, True, False,
           "weights of Llama, Qwen2/3, Mixtral, Qwen-MoE and DeepSeek-V3; the tokenizer",
           "pickled .bin weights, features hpctrain lacks, unreadable headers, shards "
           "outside the directory"),
    Format("dcp", "a torch Distributed Checkpoint of torchtitan or Megatron-Core", _is_dcp,
           _dcp_in, _dcp_out, False, True,
           "weights, Adam moments and steps (export: torchtitan's names and trainer state)",
           "code in its pickles, chunk gaps or overlaps, files outside the directory or "
           "truncated, padding other than the writer's rule"),
    Format("safetensors", "one safetensors file in hpctrain's parameter names", None,
           None, _safetensors_out, False, False,
           "weights in global shapes; the config beside it", ""),
)


def names(direction: str) -> list[str]:
    """The ``--format`` choices of ``import`` (direction "reads") or ``export`` ("writes")."""
    return [f.name for f in FORMATS if getattr(f, direction)]


def get(name: str) -> Format:
    return next(f for f in FORMATS if f.name == name)


def detect(path: str | Path, direction: str = "reads") -> Format | None:
    """The format whose files ``path`` holds, among those with ``direction``; None if none."""
    p = Path(path)
    return next((f for f in FORMATS if getattr(f, direction) and f.detect and f.detect(p)),
                None)


def described(direction: str = "reads") -> str:
    """"name: what; ..." of the formats with ``direction`` (reads, writes, init_from)."""
    return "; ".join(f"{f.name}: {f.what}" for f in FORMATS if getattr(f, direction))


def source_format(path: str | Path) -> Format:
    """The format of import source ``path``, refusing a path that is none of them."""
    found = detect(path)
    if found is None:
        raise InterchangeError(f"{path} is in no format hpctrain imports ({described()}); "
                               f"give --format to say which it is meant to be")
    return found


def markdown() -> str:
    """The table of formats in docs/interchange.md (kept current by a test)."""
    mark = {True: "yes", False: "-"}
    rows = ["|format|what it is|import|export|`init_from`|carries|refuses|",
            "|---|---|---|---|---|---|---|"]
    for f in FORMATS:
        reads = "-" if not f.reads else "yes, with `--config`" if f.needs_config else "yes"
        rows.append(f"|`{f.name}`|{f.what}|{reads}|{mark[bool(f.writes)]}|"
                    f"{mark[f.init_from]}|{f.carries}|{f.refuses or '-'}|")
    return "\n".join(rows) + "\n"
