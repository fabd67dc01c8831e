"""What maps to what between an hpctrain model and its Hugging Face class: config fields
and tensor names. The model family owns its form (``model.families``: ``hf_names``,
``hf_config``, ``hf_section``, what it refuses); this module finds the family (by the config,
or by an HF ``model_type``) and turns its answers into :class:`Entry` rows and
:class:`InterchangeError`.

Llama, Mixtral, Qwen2-MoE and Qwen3-MoE weights map 1:1 (same rotate-half rope, GQA by
repeat, SwiGLU, RMSNorm; Qwen's q/k/v biases and q/k norms are hpctrain tensors of the same
shapes), so a tensor is only renamed; an expert tensor is one slice ``[e]`` of hpctrain's
stacked ``(E, ...)`` tensor. Everything HF can express that hpctrain cannot (rope scaling,
biases other than Qwen2's q/k/v ones, sliding windows, other model types) is refused with
:class:`InterchangeError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..model.families import FAMILIES, Family, by_hf_model_type, family_of
from . import InterchangeError

INDEX = "model.safetensors.index.json"  # a sharded HF directory's map of key -> file


@dataclass(frozen=True)
class Entry:
    """One HF tensor: hpctrain parameter ``name`` (slice ``expert`` of its dim 0 when not
    None) is HF tensor ``key``; with ``rows``, row ``r`` of the parameter is HF's row
    ``rows[r]`` (DeepSeek's interleaved rotary rows)."""

    name: str
    key: str
    expert: int | None = None
    rows: tuple | None = None

    def to_hpctrain(self, t):
        """The HF tensor ``t`` (torch) in hpctrain's row order."""
        return t if self.rows is None else t[list(self.rows)]

    def to_hf(self, t):
        """hpctrain's tensor ``t`` (torch) in HF's row order."""
        if self.rows is None:
            return t
        out = t.clone()
        out[list(self.rows)] = t
        return out


def check_exportable(m: ModelConfig) -> None:
    """Refuse models transformers would load as something else (a family without a Hugging
    Face form), or forms the family's HF class cannot express (its ``hf_refusal``)."""
    refusal = family_of(m).hf.refusal(m)
    if refusal is not None:
        raise InterchangeError(refusal)


def entries(m: ModelConfig, hf: dict | None = None) -> list[Entry]:
    """Every HF tensor of the model, in HF's order (the family's ``hf.names``), as the
    config.json ``hf`` stores them (None: as export writes them)."""
    return [Entry(*row) for row in family_of(m).hf.names(m, hf)]


def hf_config(m: ModelConfig, max_positions: int, dtype: str, special: dict) -> dict:
    """config.json for transformers (``special``: bos/eos ids the tokenizer has)."""
    check_exportable(m)
    return family_of(m).hf.config(m, max_positions, dtype, special)


def _family_of_hf(hf: dict) -> Family:
    """The family of an HF config.json's ``model_type``, refusing the features it cannot
    express."""
    kind = hf.get("model_type")
    family = by_hf_model_type(kind)
    if family is None:
        known = " and ".join(f'"{f.hf.model_type}" ({f.hf.architecture})' for f in FAMILIES
                             if f.hf.model_type is not None)
        raise InterchangeError(f"model_type {kind!r} is not supported: hpctrain imports "
                               f"{known} only")
    refusal = family.hf.import_refusal(hf)
    if refusal is not None:
        raise InterchangeError(refusal)
    return family


def model_section(hf: dict, keys=None) -> dict:
    """The hpctrain ``[model]`` keys an HF config.json describes (refusing what hpctrain
    cannot express); with ``keys``, the tensor names the directory stores, also what they
    decide (DeepSeek's multi-token-prediction layers)."""
    try:
        form = _family_of_hf(hf).hf
        section = form.section(hf)
        return section if keys is None else form.stored(section, hf, keys)
    except KeyError as e:
        raise InterchangeError(f"config.json has no {e.args[0]!r}") from None
