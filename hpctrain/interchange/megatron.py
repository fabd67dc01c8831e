"""Megatron-Core's GPT (Llama form) as it lies in a ``torch_dist`` checkpoint, which is DCP
with Megatron's names (``megatron/core/models/gpt``, ``megatron/core/transformer``):

- ``embedding.word_embeddings.weight`` and ``output_layer.weight``, their vocabulary padded
  as Megatron-LM pads it (:func:`vocab_padding`): only the model's first ``vocab_size`` rows
  are read;
- per layer ``self_attention.linear_qkv.weight``, the query heads of each key/value group
  followed by that group's key and value head: rows ``(groups, heads/groups + 2, d_head,
  d_model)``; ``self_attention.linear_proj``; ``mlp.linear_fc1.weight``, the gate half then
  the up half; ``mlp.linear_fc2``;
- RMSNorm weights fused into the next linear layer (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``: Transformer Engine's layers) or as modules of their own
  (``input_layernorm``, ``pre_mlp_layernorm``: the local layer spec); ``decoder.final_layernorm``;
- layers under ``decoder.layers.N.`` or, as Megatron saves them for resharding across
  pipeline stages, stacked under ``decoder.layers.`` with the layer as the first dimension
  (one layer is read at a time);
- the distributed optimizer's state per parameter (its default ``fully_sharded_model_space``
  and ``fully_reshardable`` forms), ``optimizer.state.{exp_avg,exp_avg_sq}.<parameter key>``
  with the float32 copy as ``fp32_param`` or ``param``; the step in
  ``common.pt`` (``iteration``, the optimizer's ``param_groups``), read as data
  (:func:`common_state`).

Rotary rows are in rotate-half order unless the run set ``rotary_interleaved`` (recorded in
``common.pt``'s ``args``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from ..config import ModelConfig
from ..model.families import family_of
from . import InterchangeError, hf_map, titan
from .forms import Unit, either, paired_steps, stacked
from .pickles import load_torch_data

COMMON = "common.pt"
LATEST = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer to its newest save
TE_NORMS = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
LOCAL_NORMS = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
FLAT, FLAT_FORM = "optimizer.distributed.", "dp_reshardable"
QKV, FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"
# Megatron's tensor of a layer -> the Hugging Face tensors (after model.layers.N.) it holds
LAYER = {QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
         FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         "mlp.linear_fc2.weight": ("mlp.down_proj.weight",)}
NORM1, NORM2 = ("input_layernorm.weight",), ("post_attention_layernorm.weight",)
EMBED, HEAD, FINAL = ("embedding.word_embeddings.weight", "output_layer.weight",
                      "decoder.final_layernorm.weight")


def iteration_directory(path: Path) -> Path:
    """A Megatron-LM save directory's newest checkpoint (``iter_NNNNNNN`` or ``release``, as
    ``latest_checkpointed_iteration.txt`` names it); any other path as it is."""
    tracker = Path(path) / LATEST
    if not tracker.is_file():
        return Path(path)
    text = tracker.read_text().strip()
    sub = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if sub is None or not (Path(path) / sub).is_dir():
        raise InterchangeError(f"{tracker} names {text!r}, but {Path(path) / str(sub)} is not "
                               f"there: give the iteration directory itself")
    return Path(path) / sub


def is_megatron(keys) -> bool:
    return EMBED in keys or any(k.startswith("decoder.layers.") for k in keys)


def common_state(directory: Path) -> dict:
    """``common.pt`` (the non-sharded part of the state), read as plain data; {} when the
    directory has none."""
    path = Path(directory) / COMMON
    if not path.is_file():
        return {}
    state = load_torch_data(path, str(path))
    return state if isinstance(state, dict) else {}


def arg(common: dict, name: str, default=None, kind: type = int):
    """Megatron-LM's argument ``name`` as ``common.pt``'s ``args`` records it (a namespace,
    or its fields as a dict), else ``default``; a value that is not a ``kind`` is refused."""
    args = common.get("args")
    value = args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)
    if value is not None and value is not default and type(value) is not kind:
        raise InterchangeError(f"{COMMON}'s args record {name} = {str(value)[:60]!r}, not "
                               f"a {kind.__name__}: damaged; copy the checkpoint again")
    return value


class Padding(NamedTuple):
    """The first dimensions a padded vocabulary may be stored with, and the rule's words."""

    rows: frozenset
    rule: str


def vocab_padding(m: ModelConfig, common: dict) -> Padding:
    """The rows Megatron-LM stores for a tokenizer of ``m.vocab_size`` ids. Its
    ``_vocab_size_with_padding`` (megatron/training/tokenizer/tokenizer.py) rounds the size up
    to a multiple of ``make_vocab_size_divisible_by`` (default 128) x
    ``tensor_model_parallel_size``, both read from ``common.pt``'s ``args``. An argument the
    save does not record is taken as what Megatron-LM could have run: the default divisor
    128, and any tensor-parallel size that divides both the attention heads and the
    key/value groups (Megatron requires both), so a save without ``args`` is accepted with
    any of those sizes and nothing else."""
    v = m.vocab_size
    divisor = arg(common, "make_vocab_size_divisible_by", 128)
    tp = arg(common, "tensor_model_parallel_size")
    groups = family_of(m).kv_heads(m)
    tps = [tp] if tp is not None else [t for t in range(1, groups + 1)
                                      if m.n_heads % t == 0 and groups % t == 0]
    if not all(type(x) is int and x > 0 for x in (divisor, *tps)):
        raise InterchangeError(f"{COMMON}'s args record make_vocab_size_divisible_by "
                               f"{divisor!r} and tensor_model_parallel_size {tp!r}, not "
                               f"positive integers: damaged")
    rows = frozenset(math.ceil(v / (divisor * t)) * divisor * t for t in tps)
    said = (f"tensor_model_parallel_size {tp}" if tp is not None else
            f"tensor_model_parallel_size {either(tps)} ({COMMON} records none)")
    return Padding(rows, f"Megatron-LM rounds the vocabulary up to a multiple of "
                         f"make_vocab_size_divisible_by {divisor} x {said}; set "
                         f"model.vocab_size to the tokenizer's size the checkpoint was "
                         f"trained with")


class MegatronForm:
    """Megatron-Core's GPT in Llama form as a form (:mod:`.forms`)."""

    name = "Megatron-Core GPT"

    def __init__(self, m: ModelConfig, keys, common: dict):
        titan.check_model(m, self.name)  # the same Llama: no q/k norms or biases
        self.m, self.common = m, common
        self.stacked = "decoder.layers.self_attention.linear_qkv.weight" in keys
        self.te = any(k.endswith(TE_NORMS[0]) for k in keys)
        self.interleaved = arg(common, "rotary_interleaved", False, bool)
        padding = vocab_padding(m, common)
        self.padded = {EMBED: padding, HEAD: padding}
        self.ignored: list = []
        flat = any(k.startswith(FLAT) for k in keys)
        self.notes = [f"its optimizer state is in Megatron's {FLAT_FORM} form (flat gradient "
                      f"buffers, not per parameter) and is not read: save it with "
                      f"--dist-ckpt-optim-fully-reshardable to bring the moments"] if flat else []
        self.names = {e.key: e.name for e in hf_map.entries(m)}  # HF key -> hpctrain name
        top = [(EMBED, "model.embed_tokens.weight", m.vocab_size)]
        self.units = [Unit(k, ((self.names[hf], None),), rows=r) for k, hf, r in top]
        for i in range(m.n_layers):
            self.units += self._layer(i)
        bottom = [(FINAL, "model.norm.weight", None)] + \
            ([] if m.tie_embeddings else [(HEAD, "lm_head.weight", m.vocab_size)])
        self.units += [Unit(k, ((self.names[hf], None),), rows=r) for k, hf, r in bottom]

    def key(self, i: int, name: str) -> str:
        return f"decoder.layers.{name}" if self.stacked else f"decoder.layers.{i}.{name}"

    def _layer(self, i: int) -> list[Unit]:
        """Layer ``i``'s units: each Megatron tensor and the family's parameters in it."""
        at, hf = (i if self.stacked else None), f"model.layers.{i}."
        norms = TE_NORMS if self.te else LOCAL_NORMS
        cuts = {QKV: self._qkv(), FC1: (lambda a: a[:len(a) // 2], lambda a: a[len(a) // 2:])}
        out = []
        for key, parts in [(norms[0], NORM1), *LAYER.items(), (norms[1], NORM2)]:
            fns = cuts.get(key, (None,) * len(parts))
            out.append(Unit(self.key(i, key), tuple(
                (self.names[hf + part], fn) for part, fn in zip(parts, fns)), at))
        return out

    def _qkv(self) -> tuple:
        """Cuts of q, k and v from the fused rows (per group: its queries, its key, its
        value)."""
        m = self.m
        groups, heads, hd = family_of(m).kv_heads(m), m.n_heads, m.head_dim
        per = heads // groups

        def part(lo, hi, n):
            def cut(a):
                w = a.reshape(groups, per + 2, hd, -1)[:, lo:hi].reshape(n * hd, -1)
                return titan.to_rotate_half(w, n) if self.interleaved and lo < per + 1 else w
            return cut

        return part(0, per, heads), part(per, per + 1, groups), part(per + 1, per + 2, groups)

    def expected(self, shapes: dict) -> dict[str, tuple]:
        """The stored shapes: fused q/k/v and gate/up rows, layers stacked when they are."""
        layers = self.m.n_layers if self.stacked else None
        out = {}
        for u in self.units:
            rows = sum(shapes[name][0] for name, _ in u.parts)
            shape = (rows, *shapes[u.parts[0][0]][1:])
            out[u.key] = shape if u.index is None else stacked(shape, layers)
        return out

    def moment(self, key: str, which: str) -> str:
        return f"optimizer.state.{which}.{key}"

    def masters(self, key: str) -> tuple[str, ...]:
        """The float32 copy: ``fp32_param`` in the model-space form, ``param`` in the fully
        reshardable one."""
        return (f"optimizer.state.fp32_param.{key}", f"optimizer.state.param.{key}")

    def tied_head(self) -> str:
        return HEAD

    def naming(self) -> dict:
        return {"stacked": self.stacked, "te_norms": self.te,
                "rotary_interleaved": self.interleaved}

    def steps(self, reader) -> tuple[int, int]:
        """(training step, optimizer step) from ``common.pt``: ``iteration`` and the step
        of the optimizer's first parameter group, each standing in for the other."""
        steps = paired_steps(self.common.get("iteration"), optimizer_step(self.common),
                             f"{reader.dir / COMMON}")
        if steps is None:
            raise InterchangeError(
                f"{reader.dir} has optimizer moments but no step ({COMMON} records neither "
                f"`iteration` nor the optimizer's `step`): Adam's bias correction would be "
                f"wrong; import the weights alone from a copy without optimizer.state entries")
        return steps


def optimizer_step(common: dict):
    """The ``step`` of the first parameter group of the (possibly nested) optimizer state."""
    opt = common.get("optimizer")
    while isinstance(opt, dict) and "param_groups" not in opt and "optimizer" in opt:
        opt = opt["optimizer"]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    return groups[0].get("step") if groups else None
