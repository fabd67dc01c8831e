"""The checkpoint formats hpctrain converts, one :class:`Format` line each in
:data:`FORMATS`: how a source in it is recognised, the function that imports it as an
hpctrain checkpoint, the one that exports a checkpoint to it, and whether
``checkpoint.init_from`` starts a run from it directly. ``hpctrain import`` and ``hpctrain
export`` take their ``--format`` choices and their dispatch from here, ``init_from`` its source
kinds, and docs/interchange.md its table of formats (:func:`markdown`). Adding a format is
a module with its reader and writer and one line here (docs/design.md, "A checkpoint
format"). Functions are named as ``module:function`` of this package and imported only when
used, so the CLI's help needs neither torch nor h5py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import InterchangeError


def _is_hf(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _is_dcp(path: Path) -> bool:
    from .dcp import is_dcp_directory

    return path.is_dir() and is_dcp_directory(path)


@dataclass(frozen=True)
class Format:
    """One format. ``reads``/``writes``: ``module:function`` (None: not that direction);
    an importer is ``f(source: Path, out: Path, options: Options, say) -> Path``, an exporter
    ``f(checkpoint: Path, out: str, options: Options, say) -> Path``. ``needs_config``: the
    format does not describe its model, so import needs ``--config``."""

    name: str
    what: str
    detect: Callable[[Path], bool] | None
    reads: str | None
    writes: str | None
    init_from: bool
    needs_config: bool
    carries: str
    refuses: str

    def importer(self) -> Callable:
        return _resolve(self.reads)

    def exporter(self) -> Callable:
        return _resolve(self.writes)


@dataclass(frozen=True)
class Options:
    """What the user asked of a conversion: ``cfg`` (a Config, from ``--config``), ``dtype``,
    ``verify`` (the checkpoint's checksums first), HF's ``max_shard_size`` and
    ``tokenizer``."""

    cfg: object = None
    dtype: str = "auto"
    verify: bool = True
    max_shard_size: str = "5GB"
    tokenizer: str | None = None


FORMATS = (
    Format("hf", "a Hugging Face model directory (config.json, safetensors shards)", _is_hf,
           "hf_import:import_format", "hf_export:export_format", True, False,
           "weights of Llama, Qwen2/3, Mixtral, Qwen-MoE, DeepSeek-V3; the tokenizer; no "
           "optimizer state",
           "pickled .bin weights, features hpctrain lacks, index paths outside the directory"),
    Format("dcp", "a torch Distributed Checkpoint of torchtitan or Megatron-Core", _is_dcp,
           "trainers:import_format", "trainers:export_format", False, True,
           "weights, Adam moments and step (torchtitan; Megatron-Core's per-parameter "
           "optimizer forms); export in torchtitan's names",
           "code in its pickles, chunk gaps or overlaps, paths outside the directory, "
           "padding other than the writer's rule"),
    Format("safetensors", "one safetensors file in hpctrain's parameter names", None,
           None, "hf_export:export_safetensors_format", False, False,
           "weights (global shapes) and the resolved config beside it", ""),
)


def _resolve(name: str | None) -> Callable:
    module, function = str(name).split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


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
