"""``bench.json`` and the Markdown table: medians, ratios against targets, and whether both
sides of each comparison computed the same thing. No MPI."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def meta() -> dict:
    """Date and machine of this run (what the README's table must state)."""
    import os

    import mpi4py
    import torch

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - the library string is informative only
        mpi = "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "host": platform.node(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "mpi4py": mpi4py.__version__, "mpi": mpi}


def _fmt(x: float, unit: str) -> str:
    if unit.startswith("s"):
        return f"{x * 1e3:.2f} ms" + unit[1:]
    return f"{x:.3g} {unit}"


def _check(res: dict) -> str:
    c = res.get("check")
    if not c:
        return "-"
    return ("same" if c["ok"] else "DIFFER") + f" (rel {c['rel_err']:.1e})"


def _ratio_cell(q: dict) -> str:
    """``name = median [min-max over N pairs] (noise)``; the spread only for paired ratios."""
    cell = f"{q['name']} = {q['value']:.3g}"
    if "spread" in q:
        lo, hi = q["spread"]
        cell += f" [{lo:.3g}-{hi:.3g}, {q['pairs']} pairs]"
        cell += " **noise**" if q.get("noise") else ""
    return cell


def _load(res: dict) -> str:
    ld = res.get("load")
    return f"{ld['before'][0]:.1f} / {ld['after'][0]:.1f}" if ld else "-"


def comparisons(results: list[dict]) -> list[dict]:
    """Every comparison of the run, flat: bench, ranks, name, ratio, target, met, spread,
    pairs, noise, and the machine load before/after its part."""
    out = []
    for res in results:
        for q in res.get("ratios", []):
            out.append({"bench": res["bench"], "ranks": res.get("ranks"), "name": q["name"],
                        "ratio": q["value"], "target": q["target"], "met": q["met"],
                        "spread": q.get("spread"), "pairs": q.get("pairs"),
                        "noise": q.get("noise"), "load": res.get("load"),
                        "why": None if q["met"] else why_not(q)})
    return out


def why_not(q: dict) -> str:
    """Why a comparison missed its target: that its pairs cannot tell the sides apart
    (noise), the part's own measured reason (``why``), both, or that this run measured no
    reason."""
    noise = None
    if q.get("noise"):
        lo, hi = q["spread"]
        noise = (f"noise: the {q.get('pairs')} pairs span {lo:.3g}-{hi:.3g}, which covers 1.0; "
                 "the two sides cannot be told apart in this run")
    if q.get("why"):
        return f"{noise}; measured: {q['why']}" if noise else q["why"]
    return noise or "not met in this run; no cause measured by this part (see docs/benchmarks.md)"


def not_met(comps: list[dict], failed: int = 0) -> list[str]:
    """bench.md's list of the targets this run missed, each with its reason (``failed``:
    parts that left no result)."""
    missed = [c for c in comps if not c["met"]]
    missed_parts = ([f"{failed} part(s) FAILED (above): their targets were not measured"]
                    if failed else [])
    if not missed:
        return ["", *(missed_parts or ["Every target was met in this run."])]
    out = ["", f"Targets not met in this run ({len(missed)} of {len(comps)}), and why:", ""]
    out += [f"- {m}" for m in missed_parts]
    out += [f"- {c['bench']} ({c['ranks']} ranks), {c['name']} = {c['ratio']:.3g} "
            f"(target {c['target']}): {c['why']}" for c in missed]
    return out


def main_table(results: list[dict]) -> list[str]:
    out = ["| benchmark | ranks | variant | median | ratio [spread] | target | met | same result "
           "| load before / after |",
           "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "error" in res:
            out.append(f"| {res['bench']} | {res.get('ranks', '?')} | FAILED: "
                       f"{res['error'][:80]} | | | | | | |")
            continue
        ratios, rows = list(res.get("ratios", [])), list(res.get("rows", []))
        for i in range(max(len(rows), len(ratios))):
            r = rows[i] if i < len(rows) else None
            q = ratios[i] if i < len(ratios) else None
            cells = [res["bench"] if i == 0 else "", str(res["ranks"]) if i == 0 else "",
                     r["variant"] if r else "", _fmt(r["median"], r["unit"]) if r else "",
                     _ratio_cell(q) if q else "",
                     q["target"] if q else "", ("yes" if q["met"] else "**no**") if q else "",
                     _check(res) if i == 0 else "", _load(res) if i == 0 else ""]
            out.append("| " + " | ".join(cells) + " |")
    return out


def collectives_table(res: dict) -> list[str]:
    """OSU-style: one row per (axis, size), latency in us (bandwidth MB/s) per operation."""
    rows = res.get("table") or []
    ops = list(dict.fromkeys(r["op"] for r in rows))
    out = ["| axis (ranks) | bytes | " + " | ".join(f"{o} us (MB/s)" for o in ops) + " |",
           "|---|---|" + "---|" * len(ops)]
    keys = list(dict.fromkeys((r["axis"], r["ranks"], r["bytes"]) for r in rows))
    for axis, ranks, nbytes in keys:
        cells = []
        for o in ops:
            r = next(x for x in rows if (x["axis"], x["bytes"], x["op"]) == (axis, nbytes, o))
            cells.append(f"{r['latency_us']:.0f} ({r['bw_MBps']:.3g})")
        out.append(f"| {axis} ({ranks}) | {nbytes} | " + " | ".join(cells) + " |")
    return out


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"Measured {m['date']} on {m['host']} ({m['cpus']} CPUs, {m['platform']}), "
             f"torch {m['torch']}, {m['mpi']}; size `{doc['size']}`, {doc['repeats']} "
             "repeats, medians; ratios taken within one run: the median of the per-pair ratios "
             "of interleaved A/B runs, [min-max] over the pairs, **noise** where that spread "
             "covers 1.0.", ""]
    results = doc["results"]
    lines += main_table([r for r in results if r.get("bench") != "collectives"])
    lines += not_met(doc["comparisons"], sum("error" in r for r in results))
    for r in results:
        if r.get("what"):
            lines.append(f"\n- {r['bench']} ({r['ranks']} ranks): {r['what']}")
        for n in r.get("notes", []):
            lines.append(f"  - {n}")
    for r in results:
        if r.get("bench") == "collectives" and "error" not in r:
            lines += ["", f"Collectives through comm.py ({r['what']}):", ""]
            lines += collectives_table(r)
    return "\n".join(lines) + "\n"


def write(out_dir: Path, results: list[dict], size: str, repeats: int) -> dict:
    """Write ``bench.json`` and ``bench.md`` into ``out_dir``; returns the document."""
    doc = {"meta": meta(), "size": size, "repeats": repeats, "results": results,
           "comparisons": comparisons(results)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "bench.md").write_text(markdown(doc))
    return doc
