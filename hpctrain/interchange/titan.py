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
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..model.families import family_of
from . import hf_map
from .forms import Unit, paired_steps
from .hf_map import InterchangeError

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


@dataclass(frozen=True)
class TitanNames:
    """One torchtitan naming: ``qkv`` the projections' prefix, ``head`` the head's name,
    ``prefix`` before every model key ("" as torchtitan saves, "model." when nested)."""

    qkv: str = "attention."
    head: str = "output.weight"
    prefix: str = ""

    def key(self, hf_key: str) -> str:
        """torchtitan's key of Hugging Face key ``hf_key``."""
        if hf_key == "lm_head.weight":
            return self.prefix + self.head
        if hf_key in TOP:
            return self.prefix + TOP[hf_key]
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_key).groups()
        return f"{self.prefix}layers.{layer}." + LAYER[rest].format(qkv=self.qkv)

    def moment(self, key: str, which: str) -> str:
        """The optimizer's ``which`` (exp_avg, exp_avg_sq, step) of model key ``key``."""
        return f"optimizer.state.{key[len(self.prefix):]}.{which}"


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
    return TitanNames(qkv, head, prefix)


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


class TitanForm:
    """torchtitan's Llama 3 as a form (:mod:`.forms`): one tensor per parameter, ``wq``/``wk``
    rows in the interleaved order."""

    name = "torchtitan Llama 3"
    padded: dict = {}  # torchtitan pads nothing

    def __init__(self, m: ModelConfig, names: TitanNames):
        check_model(m)
        self.names = names
        self.ignored = [self.tied_head()] if m.tie_embeddings else []
        self.notes: list = []
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
        """(training step, optimizer step): ``train_state.step`` and the optimizer's
        per-parameter ``step``, each standing in for the other when alone."""
        key = self.moment(self.units[0].key, "step")
        opt = reader.tensor(key).item() if key in reader.tensors else None
        run = reader.object(STEP) if STEP in reader.objects else None
        return paired_steps(run.item() if hasattr(run, "item") else run, opt) or (0, 0)
