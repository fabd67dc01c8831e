"""The fields of ``metrics.jsonl`` (one record per step, written by world rank 0) and of
``summary.json`` (the run's end), each with its meaning: the one declaration of what a run
writes, documented by :func:`markdown` (docs/metrics.md). A field that a record builder adds
must be declared here (tests/unit/test_docs_reference.py reads the builders).

A name ``a.b`` is key ``b`` of the dict ``a``; ``<axis>``, ``<NAME>`` and the like stand for
any such key. Regenerate the page after changing a field::

    python -m hpctrain.telemetry.fields > docs/metrics.md
"""

from __future__ import annotations

import sys

REGENERATE = "python -m hpctrain.telemetry.fields > docs/metrics.md"

# name -> meaning, grouped: (group title, {name: meaning}); the order of the page.
METRICS: list[tuple[str, dict[str, str]]] = [
    ("Every step", {
        "step": "the step just done, counted from 1",
        "loss": "mean training loss per token of the step's global batch",
        "lr": "learning rate of the step",
        "grad_norm": "global gradient norm before clipping (each parameter counted once)",
        "data_s": "seconds the loop waited for its batch and moved it to the device",
        "step_time_s": "wall seconds of the step on rank 0",
        "time_s": "exclusive seconds per category; with `other` they add up to `step_time_s`",
        "time_s.data": "reading the batch",
        "time_s.compute": "forward and backward of every microbatch (the schedule)",
        "time_s.grad_sync": "the gradient reduction left after backward",
        "time_s.optimizer": "norm, clip and update",
        "time_s.eval": "held-out evaluation",
        "time_s.checkpoint": "saves, the local tier and waits for background writes",
        "time_s.comm_<axis>": "exposed communication on one axis (`dp`, `tp`, `pp`, `ep`, "
                              "`cp`, `world`, ...)",
        "time_s.other": "the rest of the step",
        "comm_s": "exposed communication seconds per axis (`comm_s.<axis>`)",
        "comm_bytes": "bytes posted per axis (`comm_bytes.<axis>`); a collective counts its "
                      "whole buffer",
        "busy_s": "step time minus exposed communication and pipeline bubble",
        "tokens_per_s": "global tokens of the step / step time",
        "flops_per_token": "model FLOPs per token for training (forward + backward)",
        "tflops_per_rank": "achieved model TFLOP/s per rank",
        "mfu": "`tflops_per_rank` over the nominal peak; absent when no peak is given "
               "(`telemetry.peak_flops` or `telemetry.cluster`)",
        "peak_source": "where MFU's peak came from, or why there is none",
        "matmul_tflops": "the matmul rate the start-up probe measured per rank (median over "
                         "nodes); not MFU's denominator",
        "pipeline_s": "pipeline timer categories (`pp_*`) kept apart from `time_s`, when "
                      "timed",
        "startup_s": "the first logged step only: seconds from the launch to the first "
                     "step's end, the slowest rank's per phase ([telemetry](telemetry.md))",
    }),
    ("The numeric guard and the loss scale", {
        "skipped": "the step's update was skipped (non-finite or spiking loss or norm)",
        "skips_total": "updates skipped so far in this run",
        "rollbacks": "rollbacks to a checkpoint so far",
        "skip_reason": "why the step was skipped (only on a skipped step)",
        "loss_scale": "float16: the dynamic loss scale",
        "skipped_steps": "float16: steps skipped for an overflowing gradient",
    }),
    ("Memory (measured on rank 0, bytes)", {
        "mem_params": "parameters (ZeRO-3: the shard plus the gathered peak)",
        "mem_params_gathered": "ZeRO-3: peak of the all-gathered parameters",
        "mem_grads": "gradients",
        "mem_optimizer": "optimizer state",
        "mem_activations": "peak of the saved activations of the latest metered step",
        "mem_activations_step": "that step (`telemetry.activations_every`)",
        "mem_peak": "`mem_params` + `mem_grads` + `mem_optimizer` + `mem_activations`",
        "grad_buckets_posted_in_backward": "gradient buckets whose reduction was posted "
                                           "while backward still ran (overlap)",
    }),
    ("Evaluation (every `train.eval_every` steps)", {
        "val_loss": "held-out loss per token",
        "val_loss/<NAME>": "held-out loss of one source of a blend",
    }),
    ("The first record of a run segment", {
        "run_start": "the layout this run (a start or a resume) ran on",
        "run_start.layout": "`pp=.. dp=.. ep=.. cp=.. tp=..`",
        "run_start.world_size": "number of ranks",
        "run_start.resumed_from": "the checkpoint it resumed from, or null",
    }),
    ("Stragglers (every `train.log_every` steps)", {
        "step_s_min": "fastest rank's mean step seconds since the last report",
        "step_s_median": "median over ranks",
        "step_s_max": "slowest rank's",
        "ranks": "per-rank lists, by world rank",
        "ranks.step_s": "each rank's mean step seconds",
        "ranks.busy_s": "each rank's mean busy seconds",
        "straggler": "the rank the others waited for (the most busy time)",
        "straggler.rank": "its world rank",
        "straggler.name": "its rank and grid coordinates",
        "straggler.busy_s": "its mean busy seconds",
        "straggler.median_busy_s": "median busy seconds over ranks",
        "straggler.min_busy_s": "least busy seconds over ranks",
    }),
    ("Pipeline (pp > 1)", {
        "pp_bubble": "measured bubble: mean over pp ranks of (longest step - own compute) / "
                     "longest step",
        "pp_bubble_sim": "the simulator's bubble for this schedule with the measured "
                         "costs per action kind",
        "pp_bubble_ranks": "measured bubble per pp rank",
        "pp_idle_s": "idle seconds per pp rank",
        "pp_peak_inflight": "peak live microbatches per pp rank",
    }),
    ("Mixture of experts", {
        "moe_load": "{layer: assignments routed to each expert}, summed over the step",
        "moe_dropped": "{layer: assignments dropped per expert} (capacity)",
        "moe_dropped_total": "assignments dropped in the step",
        "moe_aux_loss": "load-balancing loss: sum over layers of the microbatch mean",
        "moe_z_loss": "router z-loss, likewise",
        "moe_a2a_s": "token all-to-all seconds per rank (mean over ranks)",
        "moe_a2a_exposed_s": "the part waited for",
        "moe_a2a_hidden_s": "the part hidden behind other microbatches' compute",
    }),
    ("Checkpoints (in the step that saved, restored or saw a save end)", {
        "ckpt_blocked_s": "seconds the loop spent on the save (asynchronous: the snapshot "
                          "and any wait)",
        "ckpt_save_s": "the whole save",
        "ckpt_write_s": "the write up to the fsync, without the commit",
        "ckpt_fsync_s": "of the write: its fsync",
        "ckpt_commit_s": "after the write: `verify_write`'s read-back, rename, `latest`",
        "ckpt_save_bytes": "bytes of the checkpoint file's datasets (all ranks)",
        "ckpt_save_GBps": "those bytes / save seconds (GB/s)",
        "ckpt_background_s": "asynchronous: the writer thread's seconds",
        "ckpt_async_step": "asynchronous: the step that save holds",
        "ckpt_wait_s": "seconds a step waited for a save in flight",
        "ckpt_prev_<name>": "a second save ending in the same step: its `ckpt_<name>`",
        "ckpt_verify_s": "restore: checksum verification",
        "ckpt_load_s": "restore: the load",
        "ckpt_load_bytes": "restore: bytes this model read",
        "ckpt_load_GBps": "restore: those bytes / load seconds (GB/s)",
        "local_blocked_s": "local tier: the step's part of a local save",
        "local_save_s": "local tier: writing a generation",
        "local_send_s": "local tier: the exchange with the partner",
        "local_save_bytes": "local tier: bytes of this rank's shard",
        "local_partner_bytes": "local tier: bytes received for partners",
        "local_step": "local tier: the step of the generation that ended",
    }),
]

SUMMARY: dict[str, str] = {
    "stop_reason": "why the run stopped",
    "steps": "steps done by this run",
    "first_step": "the step it started after (0 or the step resumed)",
    "final_step": "the last step done",
    "tokens": "tokens trained by this run",
    "total_tokens": "tokens up to `final_step`, earlier runs included",
    "final_loss": "training loss of the last step (null when no step ran)",
    "final_val_loss": "the last held-out loss, or null",
    "best_val_loss": "the lowest held-out loss, or null",
    "best_val_step": "its step",
    "wall_s": "wall seconds of this invocation, set-up included",
    "run_wall_s": "wall seconds of the run's invocations that wrote a summary (a resumed run "
                  "adds its earlier ones; a killed invocation wrote none)",
    "invocations": "how many invocations run_wall_s adds up",
    "checkpoint": "the last checkpoint written, or null",
    "recovery": "how the run started",
    "recovery.tier": "`none`, `hdf5`, `local` or `partner`",
    "recovery.step": "the step restored",
    "recovery.recovery_s": "seconds to restore",
    "recovery.path": "what was read",
    "recovery.reshard": "whether it was read at another layout",
}


def metrics_fields() -> dict[str, str]:
    """Every metrics.jsonl field, flat: name -> meaning."""
    return {name: meaning for _, group in METRICS for name, meaning in group.items()}


INTRO = f"""# Metrics reference

<!-- Generated from hpctrain/telemetry/fields.py; do not edit. Regenerate: {REGENERATE} -->

`RUN_DIR/metrics.jsonl` holds one JSON object per step (world rank 0 writes it; a resume sets
the records of steps it redoes aside in `RUN_DIR/abandoned/`); `RUN_DIR/summary.json` is
written once at the end. Seconds are wall seconds; a field absent from a record was not
measured in that step. `a.b` is key `b` of the object `a`; `<axis>` and `<NAME>` stand for
any key. How to read them: [telemetry](telemetry.md).
"""


def _table(fields: dict[str, str]) -> list[str]:
    return ["|field|meaning|", "|---|---|",
            *(f"|`{k}`|{v.replace('|', chr(92) + '|')}|" for k, v in fields.items())]


def markdown() -> str:
    """docs/metrics.md: every field of metrics.jsonl and summary.json with its meaning."""
    out = [INTRO, "## metrics.jsonl", ""]
    for title, group in METRICS:
        out += [f"### {title}", "", *_table(group), ""]
    out += ["## summary.json", "", *_table(SUMMARY)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit(f"usage: {REGENERATE}")
    sys.stdout.write(markdown())
