"""torchtitan's Llama 3 as it lies in a DCP checkpoint: its tensor names and its rotary order.

torchtitan's trainer saves the model's state dict flattened at the top level
(``tok_embeddings.weight``, ``layers.N.attention.wq.weight``, ``feed_forward.w1/w2/w3``,
``attention_norm``, ``ffn_norm``, ``norm``, ``output``), its optimizer flattened by
parameter name (``optimizer.state.<name>.exp_avg|exp_avg_sq|step``) and the step as
``train_state.step``. Releases from 2026 put the projections under
``attention.qkv_linear.`` and call the head ``lm_head``: :func:`detect` reads which one a
checkpoint is, and export writes the same one back. A model saved as ``{"model": ...}``
(keys ``model.tok_embeddings.weight``) is read too.

Rotary order: torchtitan's ``wq``/``wk`` rows are in Meta's interleaved order (pairs
``2i, 2i+1`` of a head rotate together), Hugging Face's and hpctrain's in the rotate-half
order (``i`` with ``i + d/2``). :func:`to_rotate_half` and :func:`to_interleaved` move rows
between them per head, the permutation torchtitan's own Hugging Face adapter applies; Adam's
moments move with their parameter.

Interval saves (torchtitan's ``CheckpointManager``, folders ``step-N``) hold beside the model
the optimizer (per parameter ``exp_avg``, ``exp_avg_sq``, ``step`` and every hyperparameter of
its group as ``optimizer.param_groups.<name>.<key>``), ``lr_scheduler.last_epoch``, the data
loader's state (``dataloader.dp_rank_N``, a pickle of its own) and the trainer's
``train_state``: ``step`` and ``ntokens_seen``, pickled ints (the trainer's
``state_dict``), or before torchtitan 0.1 ``step`` as an int32 tensor with the loss history as
``torch.save`` bytes. Import carries the parameters, the moments and both steps, and names the
rest (:func:`left_out`); export writes every entry a ``CheckpointManager.load`` asks for except
the data loader's (:meth:`TitanForm.trainer_state`). Llama 3 since 2026 fuses ``wq``/``wk``/
``wv`` into one parameter ``attention.qkv_linear.wqkv.weight``: the model's state dict splits it
back (torchtitan's state-dict hook), its optimizer state is the fused one, rows grouped by
key/value head (``heads_per_kv`` query heads, one key, one value: :func:`split_qkv`,
:func:`fuse_qkv`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..model.families import family_of
from . import InterchangeError, hf_map
from .forms import Unit, count, paired_steps

# Hugging Face key (after ``model.layers.N.``) -> torchtitan key (after ``layers.N.``);
# {qkv}: "attention." or, since 2026, "attention.qkv_linear."
LAYER = {"self_attn.q_proj.weight": "{qkv}wq.weight",
         "self_attn.k_proj.weight": "{qkv}wk.weight",
         "self_attn.v_proj.weight": "{qkv}wv.weight",
         "self_attn.o_proj.weight": "attention.wo.weight",
         "mlp.gate_proj.weight": "feed_forward.w1.weight",
         "mlp.up_proj.weight": "feed_forward.w3.weight",
         "mlp.down_proj.weight": "feed_forward.w2.weight",
         "input_layernorm.weight": "attention_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight"}
TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
HEADS = ("output.weight", "lm_head.weight")  # the head's name before and since 2026
STEP = "train_state.step"
TOKENS = "train_state.ntokens_seen"
LAST_EPOCH = "lr_scheduler.last_epoch"
FUSED = "attention.qkv_linear.wqkv.weight"  # after layers.N.: wq, wk, wv in one parameter
STATES = ("optimizer.", "train_state.", "lr_scheduler.", "dataloader.")  # beside the model
OPTIMIZER_STATE = re.compile(r"optimizer\.state\.(.+)\.(exp_avg|exp_avg_sq|step)")


@dataclass(frozen=True)
class TitanNames:
    """One torchtitan naming: ``qkv`` the projections' prefix, ``head`` the head's name,
    ``prefix`` before every model key ("" as torchtitan saves, "model." when nested),
    ``fused_qkv`` whether the optimizer holds ``wq``/``wk``/``wv`` as one fused parameter."""

    qkv: str = "attention."
    head: str = "output.weight"
    prefix: str = ""
    fused_qkv: bool = False

    def key(self, hf_key: str) -> str:
        """torchtitan's key of Hugging Face key ``hf_key``."""
        if hf_key == "lm_head.weight":
            return self.prefix + self.head
        if hf_key in TOP:
            return self.prefix + TOP[hf_key]
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_key).groups()
        return f"{self.prefix}layers.{layer}." + LAYER[rest].format(qkv=self.qkv)

    def moment(self, key: str, which: str) -> str:
        """The optimizer's ``which`` (exp_avg, exp_avg_sq, step) of model key ``key`` (of a
        fused model its unfused name, which :class:`FusedMoments` reads)."""
        return f"optimizer.state.{key[len(self.prefix):]}.{which}"

    def optimizer_name(self, key: str) -> str:
        """The optimizer's name of the parameter holding model key ``key``."""
        name = key[len(self.prefix):]
        if self.fused_qkv and re.fullmatch(r"layers\.\d+\.attention\.qkv_linear\.w[qkv]\.weight",
                                           name):
            return name.rsplit(".", 2)[0] + ".wqkv.weight"
        return name


def check_model(m: ModelConfig, trainer: str = "torchtitan's Llama 3") -> None:
    """``trainer``'s Llama form is hpctrain's llama family without q/k norms or biases."""
    fam = family_of(m)
    if fam.name != "llama" or m.qk_norm or m.qkv_bias:
        raise InterchangeError(
            f"{trainer} checkpoints map to model.family = 'llama' without "
            f"qk_norm or qkv_bias; the config describes {fam.name}"
            f"{' with q/k norms' if m.qk_norm else ''}{' with q/k/v biases' if m.qkv_bias else ''}"
            f": give --config a Llama config of the checkpoint's shape")


def detect(keys) -> TitanNames:
    """The naming of a checkpoint whose keys are ``keys``."""
    keys = set(keys)
    prefix = "" if "tok_embeddings.weight" in keys else (
        "model." if "model.tok_embeddings.weight" in keys else None)
    if prefix is None:
        sample = ", ".join(sorted(keys)[:4])
        raise InterchangeError(f"no tok_embeddings.weight: not a torchtitan Llama checkpoint "
                               f"(its keys begin {sample})")
    qkv = "attention.qkv_linear." if f"{prefix}layers.0.attention.qkv_linear.wq.weight" in keys \
        else "attention."
    head = next((h for h in HEADS if prefix + h in keys), HEADS[0])
    return TitanNames(qkv, head, prefix, f"optimizer.state.layers.0.{FUSED}.exp_avg" in keys)


def rotary_heads(m: ModelConfig, hf_key: str) -> int | None:
    """The number of heads whose rows a rotary permutation reorders in ``hf_key`` (q or k
    projection), else None."""
    if hf_key.endswith("self_attn.q_proj.weight"):
        return m.n_heads
    if hf_key.endswith("self_attn.k_proj.weight"):
        return family_of(m).kv_heads(m)
    return None


def to_rotate_half(a: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from Meta's interleaved order to rotate-half (Hugging Face's)."""
    rows, cols = a.shape
    return a.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def to_interleaved(a: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`to_rotate_half`."""
    rows, cols = a.shape
    return a.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def split_qkv(t, kv_heads: int, width: int, part: int):
    """Rows ``part`` (0: q, 1: k, 2: v) of a fused ``wqkv`` tensor ``t`` (torch) of heads
    ``width`` wide, as a tensor of its own: ``kv_heads`` groups, each of ``heads_per_kv``
    query heads, one key and one value head (torchtitan's
    ``FusedQKVLinear._split_qkv_on_save``)."""
    cols = t.shape[1]
    w = t.reshape(kv_heads, -1, width, cols)
    per = w.shape[1] - 2
    rows = (slice(None, per), slice(per, per + 1), slice(per + 1, per + 2))[part]
    return w[:, rows].reshape(-1, cols).clone()


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int) -> np.ndarray:
    """The fused ``wqkv`` rows of ``q``, ``k``, ``v``: the inverse of :func:`split_qkv`
    (torchtitan's ``_merge_qkv_on_load``)."""
    cols, width = q.shape[1], k.shape[0] // kv_heads
    parts = (q.reshape(kv_heads, -1, width, cols), k.reshape(kv_heads, 1, width, cols),
             v.reshape(kv_heads, 1, width, cols))
    return np.concatenate(parts, axis=1).reshape(-1, cols)


class FusedMoments:
    """DCP reader ``reader`` (:class:`.dcp.Reader`) with the optimizer state of each fused
    ``wqkv`` parameter shown as that of ``wq``, ``wk`` and ``wv`` (the names of the model's
    tensors, :meth:`TitanNames.moment`); reading one reads the fused tensor and keeps its
    part. Everything else is the reader's."""

    def __init__(self, reader, m: ModelConfig):
        self.reader, self.dir, self.objects = reader, reader.dir, reader.objects
        self.tensors = dict(reader.tensors)
        self.parts: dict[str, tuple[str, int]] = {}  # shown key -> (fused key, q/k/v)
        self.kv_heads, self.width = family_of(m).kv_heads(m), m.head_dim
        rows = (m.n_heads + 2 * self.kv_heads) * self.width
        for key, (shape, dtype) in reader.tensors.items():
            found = re.fullmatch(r"optimizer\.state\.(.+\.)wqkv\.weight\.(exp_avg|exp_avg_sq)",
                                 key)
            if found is None:
                continue
            if tuple(shape) != (rows, m.d_model):
                raise InterchangeError(
                    f"{reader.dir}: {key} has shape {tuple(shape)}, not the fused q/k/v "
                    f"{(rows, m.d_model)} of {m.n_heads} query and {self.kv_heads} key/value "
                    f"heads of {self.width}: give --config the checkpoint's model")
            for part, (w, heads) in enumerate((("wq", m.n_heads), ("wk", self.kv_heads),
                                               ("wv", self.kv_heads))):
                shown = f"optimizer.state.{found[1]}{w}.weight.{found[2]}"
                self.tensors[shown] = ((heads * self.width, m.d_model), dtype)
                self.parts[shown] = (key, part)

    def tensor(self, key: str, index: int | None = None, rows: int | None = None):
        if key not in self.parts:
            return self.reader.tensor(key, index, rows)
        fused, part = self.parts[key]
        return split_qkv(self.reader.tensor(fused), self.kv_heads, self.width, part)

    def object(self, key: str):
        return self.reader.object(key)


def fused_moments(reader, m: ModelConfig):
    """``reader`` as :class:`FusedMoments` when it holds a fused ``wqkv``'s moments."""
    if any(k.startswith("optimizer.state.") and ".wqkv.weight." in k for k in reader.tensors):
        return FusedMoments(reader, m)
    return reader


def step_count(reader, key: str) -> int | None:
    """The count (a step) in entry ``key``: a one-element tensor or a pickled number; None
    when there is no such entry. Anything else is refused, naming the entry."""

    if key in reader.tensors:
        if math.prod(reader.tensors[key][0]) != 1:
            raise InterchangeError(f"{reader.dir}: {key} has shape {reader.tensors[key][0]}, "
                                   f"not one step count")
        value = reader.tensor(key).item()
    elif key in reader.objects:
        value = reader.object(key)
    else:
        return None
    return count(value, f"{reader.dir}: {key}")


def left_out(entries, tensors) -> str | None:
    """What the import does not carry of a torchtitan save whose entries are ``entries``
    (keys; ``tensors`` those of tensors), named: its state beside the model except the
    optimizer's moments and steps and ``train_state.step`` (all of them when it has no
    moments), its hyperparameters once for all parameters."""
    moments = any(OPTIMIZER_STATE.fullmatch(k) and k.endswith(".exp_avg") for k in entries)
    kept = [k for k in entries if (k in tensors and not k.startswith(STATES))
            or (moments and (k == STEP or OPTIMIZER_STATE.fullmatch(k)))]
    rest = sorted(set(entries) - set(kept))
    named, hyper = [], set()
    for key in rest:
        group = re.fullmatch(r"optimizer\.param_groups\..+\.([^.]+)", key)
        if group:
            hyper.add(group[1])
        else:
            named.append(key)
    if hyper:
        named.append(f"optimizer.param_groups.<parameter>.{{{', '.join(sorted(hyper))}}}")
    if not named:
        return None
    shown = ", ".join(named[:12]) + (f" and {len(named) - 12} more" if len(named) > 12 else "")
    return (f"not carried: {shown} (the data stream, schedule and optimizer settings are "
            f"hpctrain's own: --config)")


class TitanForm:
    """torchtitan's Llama 3 as a form (:mod:`.forms`): one tensor per parameter, ``wq``/``wk``
    rows in the interleaved order. ``entries``: every key of the checkpoint read (its
    :func:`left_out` becomes a note)."""

    name = "torchtitan Llama 3"
    padded: dict = {}  # torchtitan pads nothing

    def __init__(self, m: ModelConfig, names: TitanNames, entries=(), tensors=()):
        check_model(m)
        self.names = names
        self.ignored = [self.tied_head()] if m.tie_embeddings else []
        note = left_out(entries, tensors)
        self.notes: list = [note] if note else []
        self.rows = [(e.name, names.key(e.key), rotary_heads(m, e.key))
                     for e in hf_map.entries(m)]
        self.units = [Unit(key, ((name, None if heads is None else
                                  (lambda a, h=heads: to_rotate_half(a, h))),))
                      for name, key, heads in self.rows]

    def expected(self, shapes: dict) -> dict[str, tuple]:
        return {key: shapes[name] for name, key, _ in self.rows}

    def moment(self, key: str, which: str) -> str:
        return self.names.moment(key, which)

    def masters(self, key: str) -> tuple:
        return ()  # torchtitan's parameters are the float32 copy

    def tied_head(self) -> str:
        """The head key a tied model may store beside the embedding."""
        return self.names.prefix + self.names.head

    def naming(self) -> dict:
        return dataclasses.asdict(self.names)

    def steps(self, reader) -> tuple[int, int]:
        """(training step, optimizer step): ``train_state.step`` (a pickled int, or an int32
        tensor before torchtitan 0.1) and the optimizer's per-parameter ``step``, each
        standing in for the other when alone."""
        opt = step_count(reader, self.moment(self.units[0].key, "step"))
        return paired_steps(step_count(reader, STEP), opt) or (0, 0)

    def optimizer_params(self) -> dict[str, list]:
        """{the optimizer's parameter name: the rows (name, key, heads) it holds}: one each,
        or ``wq``, ``wk``, ``wv`` of a layer in one fused ``wqkv``."""
        out: dict[str, list] = {}
        for row in self.rows:
            out.setdefault(self.names.optimizer_name(row[1]), []).append(row)
        return out

    def written(self, moments: bool) -> dict[str, tuple]:
        """{DCP key: its pieces} of an export: a piece is (hpctrain parameter, None for its
        value or the moment it is of, rotary heads or None); a fused ``wqkv``'s moment has
        three pieces, q, k, v (:func:`fuse_qkv`)."""
        out = {key: ((name, None, heads),) for name, key, heads in self.rows}
        for param, rows in self.optimizer_params().items() if moments else ():
            out.update({f"optimizer.state.{param}.{w}": tuple((name, w, heads)
                                                              for name, _, heads in rows)
                        for w in ("exp_avg", "exp_avg_sq")})
        return out

    def trainer_state(self, optim, lr: float, shapes: dict, step: int, tokens: int) -> dict:
        """The plain entries that torchtitan's ``CheckpointManager.load`` asks for beside the
        tensors (all but its data loader's): each optimizer parameter's AdamW hyperparameters
        (``optim``, the run's ``[optim]``, at learning rate ``lr``; decay on matrices only,
        as hpctrain applies it; the scheduler's ``initial_lr`` the peak; torchtitan's default
        ``fused`` implementation), ``lr_scheduler.last_epoch`` (its schedule steps once a
        step) and the trainer's ``step`` and ``ntokens_seen``. ``shapes``: {parameter:
        shape}."""
        import torch

        group = {k: v for k, v in torch.optim.AdamW(
            [torch.zeros(1, requires_grad=True)], lr=lr, betas=(optim.beta1, optim.beta2),
            eps=optim.eps).param_groups[0].items() if k != "params"}
        group.update(initial_lr=optim.lr, fused=True, foreach=False)
        out: dict = {LAST_EPOCH: step, STEP: step, TOKENS: tokens}
        for param, rows in self.optimizer_params().items():
            decay = optim.weight_decay if len(shapes[rows[0][0]]) >= 2 else 0.0
            out.update({f"optimizer.param_groups.{param}.{k}": v
                        for k, v in {**group, "weight_decay": decay}.items()})
        return out
