"""A family's Hugging Face form, as one mapping object (:class:`HFForm`): the class and
``model_type`` of transformers it maps to, every tensor's name there, its config.json both
ways, and why a model or a config.json cannot cross. ``interchange/hf_map.py`` asks it; a
family without a form keeps the base, which refuses with the family's reason."""

from __future__ import annotations

from ...config import ModelConfig


class HFForm:
    """No Hugging Face form: every export is refused with :attr:`missing`."""

    model_type: str | None = None  # None: no Hugging Face form
    architecture: str | None = None
    missing = "the {name} family has no Hugging Face form; export --format safetensors"

    def __init__(self, family):
        self.family = family  # its name and arch, for messages and the [model] section

    def refusal(self, m: ModelConfig) -> str | None:
        """Why ``m`` cannot be exported to Hugging Face (None: it can)."""
        return (f"model.family = {self.family.name!r} cannot be exported with --format hf: "
                + self.missing.format(name=self.family.name))

    def names(self, m: ModelConfig, hf: dict | None = None) -> list:
        """Every HF tensor in HF's order: (hpctrain parameter, HF key, expert slice) or
        (..., rows): the HF row of each of the parameter's rows (None: the same). ``hf``:
        the config.json being read (None: the form export writes)."""
        raise NotImplementedError

    def config(self, m: ModelConfig, max_positions: int, dtype: str, special: dict) -> dict:
        """config.json for transformers."""
        raise NotImplementedError

    def import_refusal(self, hf: dict) -> str | None:
        """Why an HF config.json of this family cannot be imported (None: it can)."""
        return None

    def section(self, hf: dict) -> dict:
        """The hpctrain ``[model]`` keys an HF config.json of this family describes."""
        raise NotImplementedError

    def stored(self, section: dict, hf: dict, keys) -> dict:
        """``section`` with what the tensors a directory stores (``keys``) decide beside
        its config.json: the base, nothing."""
        return section
