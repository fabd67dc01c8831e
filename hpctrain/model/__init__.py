"""The model in plain PyTorch: no MPI here (see DESIGN.md)."""

from .gpt import DTYPES, GPTStage, LocalOps, ParamMeta, init_parameters, shard_range

__all__ = ["DTYPES", "GPTStage", "LocalOps", "ParamMeta", "init_parameters", "shard_range"]
