"""``hpctrain report RUN_DIR [--out DIR] [--step N]``: where the time went, as pictures.

Reads ``RUN_DIR/metrics.jsonl`` (and ``RUN_DIR/trace.json`` when the run was traced) and
writes to ``RUN_DIR/report/`` (or ``--out``):

  ``loss_lr.png``     loss, held-out loss and learning rate per step (skipped steps marked;
                      a vertical line where the run resumed on another layout)
  ``breakdown.png``   rank 0's step time stacked by category (data, compute, comm per axis,
                      optimizer, checkpoint, other)
  ``ranks.png``       per-rank step and busy time (mean over the logged intervals of the
                      last layout); the straggler is the rank with the most busy time
  ``timeline.png``    one step of the trace: per rank, phases / schedule actions and
                      communications on a common clock
  ``summary.md``      the numbers (step time per layout, breakdown, per rank, skipped
                      updates, the watchdog's message if it fired, the run's end from
                      ``summary.json``), with the pictures linked

Each run (a start or a resume) marks its first record with ``run_start`` (its layout); means
are taken per layout, never across two.

matplotlib is an optional extra (``pip install 'hpctrain[report]'``); without it only the
Markdown summary is written and the command exits 1 with a message saying so.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a run directory written by `hpctrain train`")
    p.add_argument("--out", default="", help="output directory (default RUN_DIR/report)")
    p.add_argument("--step", type=int, default=0,
                   help="step of the trace to draw in timeline.png (default: last traced)")


def load_metrics(run_dir: Path) -> list[dict]:
    """Step records, the last one written for each step (a resumed run appends)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    if not by_step:
        raise ValueError(f"{path} holds no steps")
    return [by_step[s] for s in sorted(by_step)]


def segments(metrics: list[dict]) -> list[tuple[str, list[dict]]]:
    """(layout, its records) in step order: a new segment where a run started on a layout
    other than the one before (records without ``run_start``: the layout goes on; records
    before the first that names one take its layout)."""
    out: list[tuple[str, list[dict]]] = []
    for m in metrics:
        layout = (m.get("run_start") or {}).get("layout")
        if not out or (layout is not None and out[-1][0] and layout != out[-1][0]):
            out.append((layout or "", []))
        elif layout is not None and not out[-1][0]:  # records before it named none
            out[-1] = (layout, out[-1][1])
        out[-1][1].append(m)
    return out


def mean_breakdown(metrics: list[dict]) -> dict[str, float]:
    """Mean seconds per category over the steps (rank 0), largest first."""
    keys = sorted({k for m in metrics for k in m.get("time_s", {})})
    out = {k: statistics.fmean(m.get("time_s", {}).get(k, 0.0) for m in metrics) for k in keys}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def per_rank(metrics: list[dict]) -> tuple[list[float], list[float]]:
    """Mean step and busy seconds per rank over the logged intervals."""
    rows = [m["ranks"] for m in metrics if "ranks" in m]
    if not rows:
        return [], []
    n = len(rows[0]["step_s"])
    step = [statistics.fmean(r["step_s"][i] for r in rows) for i in range(n)]
    busy = [statistics.fmean(r["busy_s"][i] for r in rows) for i in range(n)]
    return step, busy


def held_out(metrics: list[dict]) -> str:
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    if not val:
        return ""
    best = min(val, key=lambda sv: sv[1])
    return f", held-out loss final {val[-1][1]:.4f}, best {best[1]:.4f} (step {best[0]})"


def layout_lines(parts: list[tuple[str, list[dict]]]) -> list[str]:
    """Step time, throughput and MFU per layout (a run's first step, which carries its
    start-up costs, left out of the means)."""
    lines = []
    for layout, recs in parts:
        steady = recs[1:] or recs
        on = f" on {layout}" if layout else ""
        lines.append(f"- steps {recs[0]['step']}..{recs[-1]['step']}{on}: mean step time "
                     f"{statistics.fmean(m['step_time_s'] for m in steady):.4f} s (steps after "
                     f"the first), {statistics.fmean(m['tokens_per_s'] for m in steady):,.0f} "
                     "tokens/s")
        if "tflops_per_rank" in recs[-1]:
            mfu = [m["mfu"] for m in steady if "mfu" in m]
            lines.append(f"  - model {recs[-1]['flops_per_token'] / 1e6:,.3f} MFLOP/token, "
                         f"{statistics.fmean(m['tflops_per_rank'] for m in steady) * 1e3:.3f} "
                         "GFLOP/s per rank, " + (
                             f"MFU {statistics.fmean(mfu):.2%} "
                             f"({recs[-1].get('peak_source', 'nominal peak')})" if mfu else
                             f"MFU not computed ({recs[-1].get('peak_source', 'no peak')})"))
    return lines


def ending(run_dir: Path) -> list[str]:
    """The run's end as ``summary.json`` says it (written when a run ends)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return []
    s = json.loads(path.read_text())
    return [f"- stopped at step {s['final_step']}: {s['stop_reason']}; last checkpoint "
            f"{s['checkpoint'] or 'none'}; wall time {s['wall_s']:.1f} s"
            + (f" (this invocation; {s['run_wall_s']:.1f} s over the run's {s['invocations']} "
               "invocations that ended)" if s.get("invocations", 1) > 1 else "")]


def summary_md(run_dir: Path, metrics: list[dict], pngs: list[str]) -> str:
    parts = segments(metrics)
    steady = parts[-1][1][1:] or parts[-1][1]  # the last layout, after its first step
    last = metrics[-1]
    step_s = statistics.fmean(m["step_time_s"] for m in steady)
    lines = [f"# Run report: {run_dir.name}", "",
             f"- steps: {metrics[0]['step']}..{last['step']}, final loss "
             f"{last['loss']:.4f}{held_out(metrics)}, skipped updates "
             f"{last.get('skips_total', 0)}, rollbacks {last.get('rollbacks', 0)}"]
    lines += ending(run_dir) + layout_lines(parts)
    strag = [m for m in metrics if "straggler" in m]
    if strag:
        s = strag[-1]["straggler"]
        lines.append(f"- slowest rank (last interval): {s['name']}, busy {s['busy_s']:.4f} s "
                     f"vs median {s['median_busy_s']:.4f} s; step time min/median/max "
                     f"{strag[-1]['step_s_min']:.4f}/{strag[-1]['step_s_median']:.4f}/"
                     f"{strag[-1]['step_s_max']:.4f} s")
    on = f" on {parts[-1][0]}" if len(parts) > 1 else ""
    lines += ["", f"## Where the time went (rank 0{on}, mean per step after the first)", "",
              "| category | seconds | share |", "|---|---:|---:|"]
    for k, v in mean_breakdown(steady).items():
        lines.append(f"| {k} | {v:.4f} | {v / step_s:.1%} |")
    step, busy = per_rank(steady)
    if step:
        lines += ["", f"## Per rank{on} (mean over logged intervals after the first step)", "",
                  "| rank | step s | busy s |", "|---:|---:|---:|"]
        lines += [f"| {r} | {a:.4f} | {b:.4f} |" for r, (a, b) in enumerate(zip(step, busy))]
    skipped = [m for m in metrics if m.get("skipped")]
    if skipped:
        lines += ["", "## Skipped updates (numeric guard)", ""]
        lines += [f"- step {m['step']}: {m.get('skip_reason', '?')}" for m in skipped]
    watchdog = run_dir / "watchdog" / "summary.txt"
    if watchdog.is_file():
        lines += ["", "## Watchdog", "", "```", watchdog.read_text().rstrip(), "```"]
    if pngs:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


# -- plots ------------------------------------------------------------------------------
def plot_loss_lr(plt, metrics, out: Path) -> None:
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [m["loss"] for m in metrics], "o-", color="C0", ms=3, label="loss")
    bad = [m for m in metrics if m.get("skipped")]
    ax.plot([m["step"] for m in bad], [m["loss"] if m["loss"] == m["loss"] else 0 for m in bad],
            "x", color="red", label="skipped update")
    val = [m for m in metrics if "val_loss" in m]
    if val:
        ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "s--", color="C2",
                ms=4, label="held-out loss")
    for layout, recs in segments(metrics)[1:]:  # a resume on another layout
        ax.axvline(recs[0]["step"] - 0.5, color="gray", ls=":", lw=1)
        ax.annotate(f"resumed on {layout}", (recs[0]["step"] - 0.5, 1), fontsize=6,
                    xycoords=("data", "axes fraction"), va="top", rotation=90)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [m["lr"] for m in metrics], color="C1", label="learning rate")
    ax2.set_ylabel("learning rate")
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_breakdown(plt, metrics, out: Path) -> None:
    steps = [m["step"] for m in metrics]
    cats = list(mean_breakdown(metrics))
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    bottom = [0.0] * len(steps)
    for i, c in enumerate(cats):
        vals = [m.get("time_s", {}).get(c, 0.0) for m in metrics]
        ax.bar(steps, vals, bottom=bottom, label=c, color=plt.cm.tab20(i % 20))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (rank 0)")
    ax.set_title("step time by category")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_ranks(plt, metrics, out: Path) -> None:
    recs = segments(metrics)[-1][1]  # the last layout: its ranks
    step, busy = per_rank(recs[1:] or recs)  # the first step carries start-up
    ranks = list(range(len(step)))
    slow = max(ranks, key=busy.__getitem__)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r - 0.2 for r in ranks], step, width=0.4, label="step time", color="C7")
    ax.bar([r + 0.2 for r in ranks], busy, width=0.4, label="busy (not waiting)",
           color=["C3" if r == slow else "C0" for r in ranks])
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("seconds per step")
    ax.set_title(f"per-rank step time; slowest: rank {slow}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def trace_step(trace: dict, step: int) -> tuple[int, list[dict]]:
    """Events of one traced step (default: the last one traced)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in events})
    if not steps:
        raise ValueError("trace.json holds no events")
    step = step or steps[-1]
    if step not in steps:
        raise ValueError(f"step {step} is not in the trace (traced: {steps})")
    return step, [e for e in events if e["args"]["step"] == step]


def plot_timeline(plt, trace: dict, step: int, out: Path) -> int:
    step, events = trace_step(trace, step)
    t0 = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    has_actions = any(e["cat"] == "action" for e in events)
    lanes = ["action" if has_actions else "phase", "comm"]
    colors: dict[str, object] = {}
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.7 * len(ranks)))
    # Long spans first, so that short ones (drawn later) stay visible on top of them.
    events = sorted(events, key=lambda e: -e["dur"])
    for i, r in enumerate(ranks):
        for j, lane in enumerate(lanes):
            y = i * 3 + 0.4 + j  # y grows downwards (inverted axis): lane 0 on top
            for e in events:
                if e["pid"] != r or e["cat"] != lane:
                    continue
                key = e["name"].rstrip("0123456789") if lane == "action" else e["name"]
                c = colors.setdefault(key, plt.cm.tab20(len(colors) % 20))
                ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3))],
                               (y, 0.9), color=c, edgecolor="none")
    ax.set_yticks([i * 3 + 1.3 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since step start (upper lane: "
                  + ("schedule actions" if has_actions else "phases") + "; lower: comm)")
    ax.set_title(f"step {step} timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return step


def make_plots(run_dir: Path, out: Path, metrics: list[dict], step: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    plot_loss_lr(plt, metrics, out / "loss_lr.png")
    plot_breakdown(plt, metrics, out / "breakdown.png")
    made += ["loss_lr.png", "breakdown.png"]
    if any("ranks" in m for m in metrics):
        plot_ranks(plt, metrics, out / "ranks.png")
        made.append("ranks.png")
    trace = run_dir / "trace.json"
    if trace.is_file():
        plot_timeline(plt, json.loads(trace.read_text()), step, out / "timeline.png")
        made.append("timeline.png")
    return made


def run(args) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    try:
        metrics = load_metrics(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpctrain report: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    try:
        pngs = make_plots(run_dir, out, metrics, args.step)
        missing = None
    except ImportError as e:
        pngs, missing = [], e
    except ValueError as e:
        print(f"hpctrain report: {e}", file=sys.stderr)
        return 2
    (out / "summary.md").write_text(summary_md(run_dir, metrics, pngs))
    print(f"hpctrain report: wrote {out / 'summary.md'}"
          + (f" and {', '.join(pngs)}" if pngs else ""))
    if missing is not None:
        print(f"hpctrain report: no plots, matplotlib is not installed ({missing}); install "
              "the optional extra: pip install 'hpctrain[report]'", file=sys.stderr)
        return 1
    return 0
