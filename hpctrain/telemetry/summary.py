"""What a run did, said once at its end: steps, tokens, the final and best held-out loss,
wall time, the last checkpoint and why it stopped. Rank 0 prints it and writes
``RUN_DIR/summary.json`` (the same numbers)."""

from __future__ import annotations

import json
import math
from pathlib import Path


class RunSummary:
    """Fed each step's record (:meth:`add`); :meth:`finish` says it (rank 0)."""

    def __init__(self, start_step: int, tokens_per_step: int, recovery: dict | None = None):
        self.start = self.step = start_step
        self.recovery = recovery  # which tier the run started from, its step and seconds
        self.tokens_per_step = tokens_per_step
        self.loss = math.nan
        self.val: list[tuple[int, float]] = []  # (step, held-out loss)

    def add(self, record: dict) -> None:
        self.step, self.loss = int(record["step"]), float(record["loss"])
        if "val_loss" in record:
            self.val.append((self.step, float(record["val_loss"])))

    def result(self, stop: str, checkpoint: str | None, wall_s: float) -> dict:
        best = min(self.val, key=lambda sv: sv[1]) if self.val else None
        return {"stop_reason": stop, "steps": self.step - self.start, "first_step": self.start,
                "final_step": self.step, "tokens": (self.step - self.start) * self.tokens_per_step,
                "total_tokens": self.step * self.tokens_per_step,
                "final_loss": self.loss if self.step > self.start else None,
                "final_val_loss": self.val[-1][1] if self.val else None,
                "best_val_loss": best[1] if best else None,
                "best_val_step": best[0] if best else None,
                "wall_s": wall_s, "run_wall_s": wall_s, "invocations": 1,
                "checkpoint": checkpoint, "recovery": self.recovery}

    def finish(self, log, run_dir: Path, stop: str, checkpoint: str | None,
               wall_s: float) -> dict:
        out = self.result(stop, checkpoint, wall_s)
        if not log.is_writer:
            return out
        out.update(earlier(Path(run_dir) / "summary.json", wall_s, resumed=self.start > 0))
        (Path(run_dir) / "summary.json").write_text(json.dumps(out, indent=2) + "\n")

        def val(x):
            return "-" if x is None else f"{x:.4f}"

        log.info(f"run summary: {out['steps']} steps ({out['first_step']} -> "
                 f"{out['final_step']}), {out['tokens']:,} tokens, final loss "
                 f"{val(out['final_loss'])}, held-out loss final {val(out['final_val_loss'])} "
                 f"best {val(out['best_val_loss'])}"
                 + (f" (step {out['best_val_step']})" if out["best_val_step"] else "")
                 + f", wall time {wall_s:.1f} s" + (
                     f" ({out['run_wall_s']:.1f} s over the run's {out['invocations']} "
                     "invocations)" if out["invocations"] > 1 else ""))
        log.info(f"run summary: last checkpoint {checkpoint or 'none'}; stopped: {stop}")
        return out


def earlier(path: Path, wall_s: float, resumed: bool) -> dict:
    """``run_wall_s`` and ``invocations``: this invocation's wall time added, when it resumed,
    to those of the run's earlier invocations that wrote a summary (a killed one wrote none:
    not counted)."""
    try:
        before = json.loads(path.read_text()) if resumed else {}
    except (OSError, ValueError):
        before = {}
    return {"run_wall_s": float(before.get("run_wall_s", before.get("wall_s", 0.0))) + wall_s,
            "invocations": int(before.get("invocations", 1 if before else 0)) + 1}
