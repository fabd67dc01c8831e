"""Configuration: one frozen dataclass per section, TOML presets, dotted overrides, validation.

A run is a TOML file (``share/configs/``) plus ``--set section.key=value`` overrides. Each key
declares its meaning and the rule of its value alone (:func:`key`; docs/config.md is generated
from them). Unknown keys, wrong types and non-finite numbers are rejected here; what cannot
work (a layout that is not the world size, a negative learning rate) is listed by
:func:`hpctrain.checks.rules.problems` before any collective, with key, value and rule. Keys
that moved (:data:`LEGACY`) are read under their new names. Plain data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .derived import cp_factors, microbatches, shard_size, ulysses_degrees  # noqa: F401 (re-exported)
from .values import ConfigError, _coerce, parse_override, toml_key, tomllib
from .values import InputError as InputError  # re-exported: where callers find them
from .values import Source as Source
from .values import dumps_toml as dumps_toml

REDUCTIONS = ("bucketed", "bucketed-nonblocking", "per-parameter")
OVERLAP_PROGRESS = ("auto", "test", "thread", "poll", "wait")  # optim.overlap_progress
ARCHS = ("gpt", "llama")  # model.arch: the families' registry's names (a unit test)
DTYPES = ("float32", "float64", "bfloat16", "float16")  # model.dtype
RECOMPUTE = ("none", "selective", "full")  # model.recompute


def key(default: Any, help: str, *, choices: tuple = (), ge: float | None = None,
        gt: float | None = None, within: tuple | None = None) -> Any:
    """A config key as a dataclass field: its default, its meaning (metadata ``help``) and the
    rule of its value alone: one of ``choices``, ``>= ge``, ``> gt`` or in ``within = [lo, hi)``.
    ``checks.keys.key_problems`` enforces the rules, ``checks.keys.markdown`` documents them."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "within": within}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TopologyConfig:
    dp: int = key(1, "data-parallel ranks (expert parallelism is carved out of these)", ge=1)
    tp: int = key(1, "tensor-parallel ranks (Megatron-style)", ge=1)
    pp: int = key(1, "pipeline stages", ge=1)
    ep: int = key(1, "expert-parallel ranks, must divide dp", ge=1)
    cp: int = key(1, "context-parallel ranks: each holds 2 of 2*cp sequence chunks (ring "
                     "attention)", ge=1)
    cp_kind: str = key("ring", "context parallelism: ring attention, ulysses (an all-to-all "
                               "swaps sequence for heads), or hybrid (ulysses inside groups of "
                               "cp_ulysses ranks, the ring across them)",
                       choices=("ring", "ulysses", "hybrid"))
    cp_ulysses: int = key(0, "hybrid: cp ranks per Ulysses group, a divisor of cp; 0: the "
                             "largest the heads per tp rank allow within a node", ge=0)
    sequence_parallel: bool = key(False, "split the sequence over tp outside attention and the MLP")
    dp_reduction: str = key("flat", "the dp gradient reduction: one flat all-reduce, or "
                                    "hierarchical (within a node, across nodes, within)",
                                    choices=("flat", "hierarchical"))
    shard_within: str = key("", "ZeRO shard group (HSDP): \"\" all of dp*cp, \"node\" the ranks "
                                "of a node, or a size N (\"2\"); replicated across groups")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = key("gpt", "gpt (GELU MLP, multi-head attention, no positions: the default of old "
                           "configs and checkpoints) or llama (rotary positions, SwiGLU, "
                           "grouped-query attention; every preset; with num_experts > 0 the "
                           "Mixtral form); see docs/models.md")
    family: str = key("", "the model family (hpctrain/model/families; docs/models.md), which "
                          "decides the layers and the Hugging Face form; \"\": read from "
                          "model.arch and the flags, then recorded by train and import")
    n_layers: int = key(4, "transformer blocks", ge=1)
    d_model: int = key(128, "hidden size", ge=1)
    n_heads: int = key(4, "attention (query) heads", ge=1)
    n_kv_heads: int = key(0, "llama: key/value heads (grouped-query attention); 0 = n_heads", ge=0)
    rope_theta: float = key(10000.0, "llama: rotary embedding base", gt=0)
    d_head: int = key(0, "channels per attention head; 0: d_model / n_heads", ge=0)
    qk_norm: bool = key(False, "RMSNorm over each query and key head before rotary (Qwen3)")
    qkv_bias: bool = key(False, "biases on the query, key and value projections (Qwen2)")
    q_lora_rank: int = key(0, "deepseek_v3: query compression rank; 0: none", ge=0)
    kv_lora_rank: int = key(0, "deepseek_v3: key/value latent rank", ge=0)
    qk_nope_dim: int = key(0, "deepseek_v3: query/key channels per head without positions",
                           ge=0)
    qk_rope_dim: int = key(0, "deepseek_v3: rotary query/key channels per head", ge=0)
    v_head_dim: int = key(0, "deepseek_v3: value channels per head; 0: qk_nope_dim", ge=0)
    d_ff: int = key(0, "MLP hidden size; 0: 4 * d_model", ge=0)
    vocab_size: int = key(256, "embedding rows; every token id of the data needs one", ge=2)
    dtype: str = key("float32", "parameter and compute type (float16: dynamic loss scaling)",
                                choices=DTYPES)
    device: str = key("cpu", "where the model computes", choices=("cpu", "cuda"))
    tie_embeddings: bool = key(False, "the head shares the embedding matrix (needs pp=1)")
    norm_eps: float = key(1e-5, "epsilon of the layer norms", gt=0)
    init_std: float = key(0.02, "standard deviation of the initial weights", ge=0)
    mtp_depth: int = key(0, "multi-token prediction modules (DeepSeek-V3); 0: none", ge=0)
    mtp_loss_weight: float = key(0.3, "weight of the modules' mean loss", ge=0)
    recompute: str = key("none", "activations recomputed in backward: none, selective (the "
                                 "attention core softmax(QK^T)V) or full (each whole block); "
                                 "true/false read as full/none", choices=RECOMPUTE)
    num_experts: int = key(0, "experts per MoE layer; 0: a dense model", ge=0)
    top_k: int = key(1, "MoE: experts per token (at most num_experts)")
    moe_every: int = key(1, "MoE: every N-th block has experts (>= 1, <= n_layers)")
    dense_layers: int = key(0, "MoE: the first N blocks are dense", ge=0)
    capacity_factor: float = key(0.0, "MoE: tokens per expert as a factor of the even share; 0: "
                                      "dropless (>= 0)")
    aux_loss_coef: float = key(0.01, "MoE: weight of the load-balancing loss (>= 0)")
    z_loss_coef: float = key(0.001, "MoE: weight of the router z-loss (>= 0)")
    expert_d_ff: int = key(0, "MoE: hidden size of each routed expert; 0: d_ff", ge=0)
    shared_experts: int = key(0, "MoE: dense experts every token goes through beside the routed "
                                 "ones (split over tp like the MLP)", ge=0)
    shared_expert_d_ff: int = key(0, "MoE: hidden size of the shared experts together; 0: "
                                     "expert_d_ff * shared_experts", ge=0)
    shared_expert_gate: bool = key(False, "MoE: scale the shared experts' output by "
                                          "sigmoid(x . w), as Qwen2-MoE")
    router_score: str = key("softmax", "MoE: router scores, softmax or sigmoid (DeepSeek-V3)",
                            choices=("softmax", "sigmoid"))
    norm_topk_prob: str = key("auto", "MoE: top-k weights renormalised to sum 1: true, false or "
                                      "auto (the family's: when k > 1; mixtral always)",
                              choices=("auto", "true", "false"))
    routed_scaling_factor: float = key(1.0, "MoE: factor on the routed experts' weights", gt=0)
    bias_update_rate: float = key(0.0, "MoE: aux-loss-free balancing: per-expert selection "
                                       "bias += rate * sign(mean load - load) each step; 0: off",
                                  ge=0)
    route_groups: int = key(1, "MoE: experts in this many groups for group-limited routing",
                            ge=1)
    route_top_groups: int = key(0, "MoE: groups each token picks first (by the sum of its top-2 "
                                   "scores per group); 0: all", ge=0)

    def __post_init__(self):  # the boolean form of recompute, as the Python API gives it
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if isinstance(self.norm_topk_prob, bool):
            object.__setattr__(self, "norm_topk_prob", str(self.norm_topk_prob).lower())

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def expert_dim(self) -> int:
        """Hidden size of one routed expert."""
        return self.expert_d_ff or self.ffn_dim

    @property
    def shared_dim(self) -> int:
        """Hidden size of the shared experts together (0: none)."""
        if not self.shared_experts:
            return 0
        return self.shared_expert_d_ff or self.expert_dim * self.shared_experts

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def value_dim(self) -> int:
        """Value channels per head of latent attention."""
        return self.v_head_dim or self.qk_nope_dim

    def moe_layer(self, i: int) -> bool:
        """Whether block ``i`` has experts: past the first ``dense_layers`` blocks, every
        ``moe_every``-th (blocks ``moe_every - 1``, ``2 * moe_every - 1``, ...)."""
        return self.num_experts > 0 and i >= self.dense_layers and (i + 1) % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads asked for (0: ``n_heads``). The attention uses the family's
        (``model.families``); one without grouped-query attention accepts only 0 or n_heads."""
        return self.n_kv_heads or self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    steps: int = key(100, "optimizer steps", ge=0)
    global_batch_size: int = key(8, "sequences per optimizer step", ge=1)
    micro_batch_size: int = key(1, "sequences per rank per microbatch", ge=1)
    seq_len: int = key(64, "tokens per sequence", ge=1)
    seed: int = key(1234, "seeds the initial weights and the data order", within=(0, 2**63))
    log_every: int = key(1, "log a metrics line every N steps (0: as 1)", ge=0)
    eval_every: int = key(0, "evaluate on the validation split every N steps (0: never)", ge=0)
    eval_batches: int = key(2, "global batches per evaluation (>= 1 when evaluating)", ge=0)
    max_wall_s: float = key(0.0, "stop after this many seconds; 0: no wall-time budget", ge=0)
    target_val_loss: float = key(0.0, "stop when the validation loss reaches it (0: off)", ge=0)
    patience: int = key(0, "stop after N evaluations without improvement (0: off)", ge=0)
    slurm_margin_s: float = key(60.0, "stop this long (+2 steps) before the SLURM job's end", ge=0)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = key(3e-3, "peak learning rate (AdamW)", ge=0)
    min_lr: float = key(3e-4, "learning rate at the end of the cosine decay (<= lr)", ge=0)
    warmup_steps: int = key(10, "linear warmup steps", ge=0)
    decay_steps: int = key(0, "lr is min_lr after this step; 0: train.steps (resume: kept)", ge=0)
    weight_decay: float = key(0.1, "AdamW weight decay", ge=0)
    beta1: float = key(0.9, "AdamW beta1", within=(0, 1))
    beta2: float = key(0.95, "AdamW beta2", within=(0, 1))
    eps: float = key(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = key(1.0, "clip the global gradient norm to this; 0: no clipping", ge=0)
    zero: int = key(0, "ZeRO stage: 0 replicated, 1 optimizer state sharded over dp, 2 gradients "
                       "too, 3 parameters too (gathered per block)", choices=(0, 1, 2, 3))
    bucket_mb: float = key(4.0, "gradient bucket size for the data-parallel reduction", gt=0)
    overlap: bool = key(False, "post bucket reductions during the last backward")
    overlap_across_nodes: bool = key(True, "overlap, though overlap is false, where the dp (or "
                                           "edp) group crosses nodes and the reduction is the flat "
                                           "bucketed one (docs/results.md, \"Overlapped gradient "
                                           "reduction\")")
    overlap_progress: str = key("auto", "what advances overlapped reductions while backward "
                                        "computes: thread (a thread runs each bucket's blocking "
                                        "collective as it is posted; needs MPI_THREAD_MULTIPLE), "
                                        "test (MPI_Test from every gradient hook), poll (the "
                                        "thread tests nonblocking collectives every 0.5 ms), wait "
                                        "(the final wait alone), auto (test: measured fastest "
                                        "where ranks share their cores)",
                                        choices=OVERLAP_PROGRESS)
    grad_comm_dtype: str = key("", "what gradient reductions carry: \"\" the gradients' dtype; "
                                   "bfloat16 half float32's bytes (accumulation and the "
                                   "optimizer stay float32); float16 is refused (its range)",
                               choices=("", "bfloat16", "float16"))
    loss_scale: float = key(65536.0, "float16: initial dynamic loss scale", gt=0)


@dataclass(frozen=True)
class DataConfig:
    path: str = key("", "HDF5 file from `hpctrain prepare`; \"\" = the embedded corpus")
    sources: tuple = key((), "blend: [{path = \"a.h5\", weight = 0.7}, ...] instead of path "
                             "(docs/data.md)")
    corpus_mb: float = key(2.0, "size of the embedded corpus (Python's own sources)", gt=0)
    tokenizer: str = key("", "embedded corpus: tokenizer.json, \"\" = bytes (a file has its own)")
    val_fraction: float = key(0.05, "share of the tokens held out for validation", within=(0, 1))
    allow_changed: bool = key(False, "resume though the sample stream changes (recorded)")
    document_mask: bool = key(False, "attention stays inside each document; positions restart")
    prefetch: bool = key(True, "read the next step's batch in a thread during this step")


@dataclass(frozen=True)
class ScheduleConfig:
    kind: str = key("1f1b", "pipeline schedule (zbv, dualpipev: a V of 2 chunks); the names of "
                    "the schedules' registry, hpctrain/pipeline/schedules.py")
    virtual_stages: int = key(1, "chunks per rank for kind = interleaved", ge=1)
    boundaries: str = key("", "\"3,6\": first layer of (virtual) stages 1..S-1; \"\" balanced")
    moe_overlap: bool = key(False, "expert all-to-alls as actions overlapped with compute")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = key("", "where checkpoints go; \"\" = RUN_DIR/checkpoints")
    every: int = key(0, "save every N steps; 0: only at the end (when save_final)", ge=0)
    resume: str = key("auto", "\"auto\" the run's newest checkpoint if any, \"never\", or a path")
    init_from: str = key("", "a new run's parameters from a checkpoint or a Hugging Face directory")
    keep: int = key(3, "checkpoints kept; 0: every one", ge=0)
    save_final: bool = key(True, "save a checkpoint after the last step")
    alignment: int = key(0, "HDF5 alignment in bytes (e.g. the Lustre stripe size); 0 = off", ge=0)
    mpi_hints: dict = key({}, "MPI-IO hints, e.g. {striping_factor = 4}")
    async_: bool = key(False, "TOML key `async`: write in the background, the step only copies")
    collective_io: bool = key(False, "collective MPI-IO for datasets >= 64 KiB (ROMIO aggregators)")
    verify_write: bool = key(False, "read every byte back and compare checksums before commit")
    local_every: int = key(0, "node-local + partner-node copy every N steps; 0: off", ge=0)
    local_dir: str = key("/dev/shm/hpctrain/{node}", "node-local directory; {node}: host name")
    local_keep: int = key(1, "complete local generations kept (+1 being written)", choices=(1, 2))


@dataclass(frozen=True)
class TelemetryConfig:
    trace: bool = key(False, "write a Chrome trace (trace.json)")
    trace_steps: str = key("1-3", "step window kept in trace.json: \"A-B\", \"N\" or \"all\"")
    watchdog_s: float = key(600.0, "a rank without progress for max(watchdog_s, watchdog_factor x "
                                   "its slowest step) ends the job, naming the stuck rank "
                                   "(checkpoints get 10x; docs/telemetry.md); 0: off", ge=0)
    watchdog_factor: float = key(10.0, "x the slowest step so far (saves, evaluations included); "
                                       "0: the fixed watchdog_s alone", ge=0)
    peak_flops: float = key(0.0, "nominal peak FLOP/s per rank, MFU's denominator (wins over "
                                 "cluster); 0 and no cluster: MFU not computed", ge=0)
    cluster: str = key("", "cluster description (as plan --cluster) whose [peak_flops] of "
                           "model.dtype is MFU's denominator")
    tensorboard: bool = key(False, "TensorBoard event files in RUN_DIR/tensorboard (rank 0)")
    wandb: str = key("", "\"offline\": an offline W&B run in RUN_DIR/wandb (rank 0; `wandb "
                         "sync` later); \"\": off", choices=("", "offline"))
    activations_every: int = key(20, "count activation bytes (saved-tensor hooks, which cost time "
                                     "per saved tensor) at the first step and every N-th step "
                                     "after", ge=1)
    max_skips: int = key(3, "consecutive non-finite/spiking steps before on_skips; 0: never", ge=0)
    on_skips: str = key("rollback", "rollback to the last checkpoint, or stop",
                                    choices=("rollback", "stop"))
    loss_spike: float = key(0.0, "bad step: a loss > this (> 1) x the recent mean; 0: off", ge=0)


def trace_window(text: str) -> tuple[int, int]:
    """``telemetry.trace_steps``: ``"3"`` -> (3, 3), ``"1-3"`` -> (1, 3), ``""``/``"all"``: all."""
    lo, _, hi = text.strip().partition("-")
    if lo in ("", "all") and not hi:
        return 1, 2**62
    if not (lo.strip().isdigit() and (hi or lo).strip().isdigit()):
        raise ValueError(f"telemetry.trace_steps={text!r}: expected 'A-B', 'N' or 'all'")
    if not 1 <= int(lo) <= int(hi or lo):
        raise ValueError(f"telemetry.trace_steps={text!r}: need 1 <= A <= B")
    return int(lo), int(hi or lo)


@dataclass(frozen=True)
class ExperimentalConfig:
    """Settings that exist only for comparisons and tests, not for production runs."""

    reduction: str = key("bucketed", "how gradients are summed over dp without overlap: bucketed "
                                     "(one blocking all-reduce per bucket, in order), "
                                     "bucketed-nonblocking (every bucket posted, then waited for), "
                                     "per-parameter (one blocking all-reduce per parameter: the "
                                     "naive baseline)", choices=REDUCTIONS)
    placement: str = key("auto", "auto: ranks packed by node, tp inside a node; naive: tp strided "
                                 "across nodes, for comparison", choices=("auto", "naive"))
    p2p_wait: str = key("yield", "pipeline receives: yield (poll, then sleep) or spin (MPI_Wait)",
                                 choices=("yield", "spin"))
    faults: str = key("", "injected faults, e.g. \"kill@1:3;ckpt_kill@0:4\" (the same "
                          "as $HPCTRAIN_FAULTS; every kind: hpctrain/faults.py)")


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
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)


# Keys that moved, as stored in older checkpoints and presets: read under their new name.
LEGACY = {
    "optim.reduction": "experimental.reduction",
    "topology.placement": "experimental.placement",
    "schedule.p2p_wait": "experimental.p2p_wait",
    "telemetry.faults": "experimental.faults",
}
SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


def renamed(section: str, key: str) -> tuple[str, str]:
    """Where ``section.key`` lives now: the new place of a :data:`LEGACY` key, else itself."""
    return tuple(LEGACY.get(f"{section}.{key}", f"{section}.{key}").split(".", 1))


def upgrade(raw: dict) -> dict:
    """``raw`` with every :data:`LEGACY` key under its new name (a copy; the new name wins
    where both are given)."""
    out = {name: dict(body) if isinstance(body, dict) else body for name, body in raw.items()}
    for old, new in LEGACY.items():
        (section, key), (to, name) = old.split("."), new.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            value = out[section].pop(key)
            if isinstance(out.setdefault(to, {}), dict):
                out[to].setdefault(name, value)
    model = out.get("model")
    flag = str(model.get("recompute")).lower() if isinstance(model, dict) else ""
    if flag in ("true", "false"):  # the boolean form of model.recompute
        model["recompute"] = "full" if flag == "true" else "none"
    if isinstance(model, dict) and isinstance(model.get("norm_topk_prob"), bool):
        model["norm_topk_prob"] = str(model["norm_topk_prob"]).lower()  # TOML's true/false
    return out


def from_dict(raw: dict) -> Config:
    """A Config from nested dicts (unknown sections/keys, wrong types refused; LEGACY read)."""
    sections = {}
    for name, body in upgrade(raw).items():
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
    raw = upgrade(raw)
    for text in overrides:
        section, key, value = parse_override(text)
        section, key = renamed(section, key)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        raw[section][key] = value
    return from_dict(raw)
