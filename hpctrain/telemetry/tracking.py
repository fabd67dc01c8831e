"""Experiment tracking on world rank 0: TensorBoard event files and an offline W&B run.

``telemetry.tensorboard = true`` writes ``RUN_DIR/tensorboard/`` with
``torch.utils.tensorboard.SummaryWriter``; ``telemetry.wandb = "offline"`` writes
``RUN_DIR/wandb/offline-run-*`` (``wandb sync`` uploads it later). Both get every number of
each step's record (:func:`scalars`: loss, lr, grad norm, throughput, MFU, seconds per
category, held-out loss, memory...) at its step, and the resolved config and the run's
lineage: a text summary in TensorBoard, the run's config in W&B. W&B runs with its
environment set so that it never reaches a server (:func:`offline_environment`). Each
package is imported only when its key asks for it; ``hpctrain train`` refuses a run whose
package is missing before any collective (``checks.inputs.tracking_problems``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

SKIPPED = ("ranks", "run_start")  # per-rank lists, the layout: not time series


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a step record by tag: top-level numbers as they are named,
    numbers one level down as ``outer/inner`` (``time_s/compute``, ``comm_bytes/dp``)."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in SKIPPED or k == "step":
            continue
        items = v.items() if isinstance(v, dict) else [(None, v)]
        for inner, x in items:
            if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                out[k if inner is None else f"{k}/{inner}"] = float(x)
    return out


def offline_environment(run_dir: Path) -> dict[str, str]:
    """The environment that keeps W&B on this machine: offline mode, its files in the run
    directory, no console capture, no code or git lookups. Set before ``wandb`` is imported."""
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(run_dir), "WANDB_SILENT": "true",
           "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true", "WANDB_DISABLE_GIT": "true",
           "WANDB_CACHE_DIR": str(run_dir / "wandb" / "cache"),
           "WANDB_CONFIG_DIR": str(run_dir / "wandb" / "config")}
    os.environ.update(env)
    return env


class Trackers:
    """The trackers the config asks for (rank 0; other ranks hold none and pay nothing)."""

    def __init__(self, cfg, run_dir: Path, config_toml: str, lineage: dict, is_writer: bool):
        tc = cfg.telemetry
        self.tb = self.wb = None
        if not is_writer:
            return
        if tc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            self.tb.add_text("config", "```toml\n" + config_toml + "\n```")
            self.tb.add_text("lineage", "```json\n" + json.dumps(lineage, indent=2) + "\n```")
        if tc.wandb == "offline":
            import dataclasses

            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            offline_environment(run_dir)
            import wandb

            hook = sys.excepthook  # hpctrain's (ends the job on an error); wandb's own
            self.wb = wandb.init(
                mode="offline", dir=str(run_dir), project="hpctrain", name=run_dir.name,
                config={"config": dataclasses.asdict(cfg), "lineage": lineage},
                settings=wandb.Settings(console="off", disable_git=True, save_code=False,
                                        x_disable_stats=True, silent=True))
            sys.excepthook = hook  # would print the traceback, then pass it on: printed twice

    def log(self, record: dict) -> None:
        step = int(record["step"])
        values = scalars(record)
        if self.tb is not None:
            for tag, x in values.items():
                self.tb.add_scalar(tag, x, step)
        if self.wb is not None:
            self.wb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
