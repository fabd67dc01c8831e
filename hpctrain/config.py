"""Configuration: one frozen dataclass per section, TOML presets, dotted overrides, validation.

A run is described by a TOML file (see ``share/configs/``) plus ``--set section.key=value``
overrides. Unknown keys, wrong types and non-finite numbers are rejected here, with the list
of valid keys; values and layouts that cannot work (``dp*tp*pp != world size``, a negative
learning rate) are listed by :func:`hpctrain.checks.rules.problems` and rejected by
:func:`hpctrain.checks.validate.validate` before any collective is called, with the key, the value
and the rule (or the arithmetic) in the message. Imports nothing of hpctrain: plain data.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


REDUCTIONS = ("bucketed", "bucketed-nonblocking", "per-parameter")
# How overlapped reductions progress while backward computes (optim.overlap_progress).
OVERLAP_PROGRESS = ("auto", "test", "thread", "poll", "wait")
# model.arch: the spellings of hpctrain.model.families' registry (a unit test keeps them equal)
ARCHS = ("gpt", "llama")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says why and how to fix it."""


class InputError(ConfigError):
    """What a valid configuration points at cannot be used: the data file (missing, damaged,
    not hpctrain's, ids past the vocabulary), the run or checkpoint directory. Raised
    deliberately before any collective, alike on every rank."""


@dataclass(frozen=True)
class TopologyConfig:
    dp: int = 1  # data-parallel ranks (expert parallelism is carved out of these)
    tp: int = 1  # tensor-parallel ranks (Megatron-style)
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel ranks, must divide dp
    cp: int = 1  # context-parallel ranks: each holds 2 of 2*cp sequence chunks (ring attention)
    sequence_parallel: bool = False
    placement: str = "auto"  # "auto": tp inside a node; "naive": rank order, for comparison
    dp_reduction: str = "flat"  # "flat" or "hierarchical" (within node, across, within)


@dataclass(frozen=True)
class ModelConfig:
    # "gpt" (GELU MLP, multi-head attention, no positions: the default of old configs and
    # checkpoints) or "llama" (rotary positions, SwiGLU, grouped-query attention; every
    # preset); with num_experts > 0, llama is the Mixtral form. See docs/models.md.
    arch: str = "gpt"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0 = n_heads
    rope_theta: float = 10000.0  # llama: rotary embedding base
    d_ff: int = 0  # 0: 4 * d_model
    vocab_size: int = 256
    dtype: str = "float32"  # float32, float64, bfloat16, float16 (dynamic loss scaling)
    device: str = "cpu"  # cpu or cuda
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    recompute: bool = False
    num_experts: int = 0  # 0: dense model
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads asked for: ``n_kv_heads``, 0 meaning ``n_heads``. What the
        attention uses is the family's (``model.families``): a family without grouped-query
        attention has ``n_heads`` and its checks accept only 0 or ``n_heads`` here."""
        return self.n_kv_heads or self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch_size: int = 8  # sequences per optimizer step
    micro_batch_size: int = 1  # sequences per rank per microbatch
    seq_len: int = 64
    seed: int = 1234
    log_every: int = 1
    eval_every: int = 0  # evaluate on the validation split every N steps (0: never)
    eval_batches: int = 2  # global batches per evaluation
    max_wall_s: float = 0.0  # 0: no wall-time budget
    target_val_loss: float = 0.0  # stop when reached (0: off)
    patience: int = 0  # stop after N evaluations without improvement (0: off)
    slurm_margin_s: float = 60.0  # stop this long (+2 steps) before the SLURM job's end


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping
    zero: int = 0  # 0, 1 or 2
    bucket_mb: float = 4.0  # gradient bucket size for the data-parallel reduction
    overlap: bool = False  # post bucket reductions during the last backward
    # ... and do so, though overlap is false, where the dp (or edp) group crosses nodes and
    # the reduction is the flat bucketed one: measured faster over TCP, slower on shared
    # memory (docs/benchmarks.md, "Overlap and the naive baseline").
    overlap_across_nodes: bool = True
    # How gradients are summed over dp without overlap: "bucketed" (one blocking all-reduce
    # per bucket, in order), "bucketed-nonblocking" (every bucket posted, then waited for),
    # "per-parameter" (one blocking all-reduce per parameter: the naive baseline).
    reduction: str = "bucketed"
    # What advances overlapped reductions (overlap or zero 2) while backward computes:
    # "thread" (a thread owning a duplicate communicator runs each bucket's blocking
    # all-reduce / reduce-scatter as it is posted; needs MPI_THREAD_MULTIPLE), "test" (libnbc
    # nonblocking collectives, MPI_Test on them from every gradient hook), "poll" (the thread
    # posts libnbc collectives and tests them every 0.5 ms), "wait" (the final wait alone), or
    # "auto": "thread" where the dp group crosses nodes and MPI provides MPI_THREAD_MULTIPLE,
    # else "test" (and then overlap_across_nodes does not turn overlap on): the choice
    # measured on a quiet machine (docs/benchmarks.md, "Overlap and the naive baseline").
    overlap_progress: str = "auto"
    loss_scale: float = 65536.0  # float16: initial dynamic loss scale


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # HDF5 from `hpctrain prepare`; "" = the embedded corpus
    corpus_mb: float = 2.0  # size of the embedded corpus (Python's own sources)
    tokenizer: str = ""  # tokenizer.json for the embedded corpus; "" = byte-level tokens
    val_fraction: float = 0.05
    allow_changed: bool = False  # resume on data whose content hash differs (recorded)


@dataclass(frozen=True)
class ScheduleConfig:
    kind: str = "1f1b"  # gpipe, 1f1b, interleaved, zb-h1, zbv (V-shaped, 2 chunks per rank)
    virtual_stages: int = 1
    boundaries: str = ""  # "3,6": first layer of (virtual) stages 1..S-1; "" balanced
    moe_overlap: bool = False  # expert all-to-alls as D/C actions overlapped with compute
    p2p_wait: str = "yield"  # pipeline receives: "yield" (poll, then sleep) or "spin" (Wait)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # "" = RUN_DIR/checkpoints
    every: int = 0  # 0: only at the end (when save_final)
    resume: str = ""  # "" fresh, "auto" latest if any, or a checkpoint path
    init_from: str = ""  # a new run's parameters from a checkpoint or a Hugging Face directory
    keep: int = 3
    save_final: bool = True
    alignment: int = 0  # HDF5 alignment in bytes (e.g. the Lustre stripe size); 0 = off
    mpi_hints: dict = field(default_factory=dict)  # MPI-IO hints, e.g. striping_factor
    async_: bool = False  # TOML key `async`: write in the background, the step only copies
    collective_io: bool = False  # collective MPI-IO for datasets >= 64 KiB (ROMIO aggregators)
    verify_write: bool = False  # read every byte back and compare checksums before commit


@dataclass(frozen=True)
class TelemetryConfig:
    trace: bool = False
    trace_steps: str = "1-3"  # step window kept in trace.json
    # Watchdog (docs/telemetry.md): a rank without progress for max(watchdog_s, watchdog_factor
    # x its slowest step so far) ends the job, naming the stuck rank (checkpoints get 10x).
    watchdog_s: float = 600.0  # the floor in seconds; 0: the watchdog is off
    watchdog_factor: float = 10.0  # x the slowest step (saves, evaluations included); 0: fixed
    peak_flops: float = 0.0  # per rank; 0 = measure at start
    # saved-tensor hooks count activation bytes (mem_activations) at the run's first step and
    # every N-th step after; they cost ~6 us per saved tensor (16 % of a small model's step)
    activations_every: int = 20
    max_skips: int = 3  # consecutive non-finite/spiking steps before on_skips; 0: never
    on_skips: str = "rollback"  # "rollback" to the last checkpoint, or "stop"
    loss_spike: float = 0.0  # a loss > this x the recent mean is a bad step; 0: off
    faults: str = ""  # tests only: e.g. "kill@1:3;stall@0:2:60" (telemetry/fault_injection.py)


@dataclass(frozen=True)
class Config:
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)


SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of ``default``; ints are accepted for floats."""
    where = f"{section}.{key}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:
                raise ConfigError(f"{where} must be a 64-bit integer, got {value!r}")
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2**1023 else math.inf  # huge TOML ints
            if not math.isfinite(number):
                raise ConfigError(f"{where} must be a finite number, got {value!r}")
            return number
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if isinstance(default, dict):
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        raise ConfigError(f"{where} must be a table, got {value!r}")
    return value


def toml_key(name: str) -> str:
    """A field's key in TOML and ``--set``: a Python keyword is spelled with a trailing
    underscore in the dataclass (``async_``) and without it in the file (``async``)."""
    return name[:-1] if name.endswith("_") else name


def from_dict(raw: dict) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections/keys and wrong types."""
    sections = {}
    for name, body in raw.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(f"unknown section [{name}]; valid: {', '.join(_SECTION_TYPES)}")
        if not isinstance(body, dict):
            raise ConfigError(f"[{name}] must be a table of keys")
        proto = _SECTION_TYPES[name]()
        valid = {toml_key(f.name): f.name for f in fields(proto)}
        values = {}
        for key, value in body.items():
            if key not in valid:
                raise ConfigError(
                    f"unknown key {name}.{key}; valid keys of [{name}]: {', '.join(sorted(valid))}"
                )
            values[valid[key]] = _coerce(name, key, value, getattr(proto, valid[key]))
        sections[name] = dataclasses.replace(proto, **values)
    return Config(**sections)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is read as a TOML literal
    (``3``, ``1e-3``, ``true``, ``"x"``) and falls back to a bare string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key, value


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML preset (or defaults when path is None) and apply dotted overrides."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            why = "is not a file" if p.exists() else "does not exist"
            raise ConfigError(f"config file {p} {why}")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        raw[section][key] = value
    return from_dict(raw)


def dumps_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to every run directory and checkpoint)."""

    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {lit(x)}" for k, x in v.items()) + "}"
        return repr(v)

    out = []
    for name, body in to_dict(cfg).items():
        out.append(f"[{name}]")
        out += [f"{toml_key(k)} = {lit(v)}" for k, v in body.items()]
        out.append("")
    return "\n".join(out)


def microbatches(cfg: Config) -> int:
    t = cfg.train
    return t.global_batch_size // (cfg.topology.dp * t.micro_batch_size)
