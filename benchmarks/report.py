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


# -- docs/benchmarks.md: the page, generated from recorded runs ----------------------------

REGENERATE = "python -m benchmarks.report docs/bench.json > docs/benchmarks.md"

PREAMBLE = f"""# Benchmarks

<!-- Generated from docs/bench.json by benchmarks/report.py; do not edit. Regenerate:
{REGENERATE} -->

`make bench` (that is `python -m benchmarks --out runs/bench`, from the repository root;
`BENCH_ARGS="--only NAME --size tiny --repeats N"` passes options) runs every part below,
launching the MPI ranks itself, and writes `bench.json` and `bench.md` into `runs/bench/`. Each part
compares hpctrain with PyTorch, the naive baseline or the limit on the same model, init, data
and batch, and checks that both sides computed the same thing (losses, or reduced
gradients). Each ratio is the median of per-pair ratios of A/B runs interleaved in one launch
(at least 5 pairs), with its spread [min-max] over the pairs, **noise** where the spread
covers 1.0; every part records the load average before and after it, and, for a target
missed, its own measured reason. Judge throughput on a machine with a core per rank and
nothing else running. `--size tiny` is the seconds-long smoke test (no figures).

To record a run here, add its `bench.json` to the list in `docs/bench.json` (newest first)
and regenerate this page. The measured figures that matter, with their context, are
collected in [results](results.md).

## The parts
"""


PARTS = {  # what each part of benchmarks/ compares (its module's docstring says more)
    "gradsync": "the bucketed gradient reduction against one call per parameter (naive) and "
                "one raw all-reduce of all gradient bytes (the limit)",
    "overlap": "exposed gradient-sync time with and without overlap, per "
               "`optim.overlap_progress`",
    "ddp": "`hpctrain train` at dp=2 against PyTorch DDP (gloo)",
    "pipeline": "1F1B against `Schedule1F1B` (gloo); at pp=4 the zero-bubble schedules "
                "against 1F1B, their split backward's cost, the measured bubble against the "
                "simulator's",
    "overhead": "an `hpctrain train` step against a plain PyTorch loop",
    "collectives": "latency and bandwidth per axis of a dp=2 x tp=2 grid (OSU-style)",
    "checkpoint": "the parallel-HDF5 save and load against per-rank `torch.save` and a raw "
                  "write and read",
    "memory": "memory per rank and step time for ZeRO 0-3",
    "scaling": "1, 2 and 4 ranks, the naive design against hpctrain's defaults",
    "cluster": "2 simulated nodes: placement, hierarchical dp, overlap",
    "nodes": "2 simulated nodes x 2 ranks: hpctrain's best layouts against the naive "
             "baseline, DDP, FSDP2, the bound and the plan's prediction",
    "data": "`hpctrain prepare` against the tokenizers library; the data share of a "
            "training step; peak RSS against corpus size",
    "context_kinds": "ring, Ulysses and hybrid context parallelism: step time and memory",
    "relaunch": "time to recover and steps lost: requeue, relaunch, the local tier",
    "faults": "a seeded campaign of 100 faults (9 in CI) on 3 simulated nodes: faults "
              "survived, steps lost, recovery time, the final state against an uninterrupted "
              "run's, byte for byte",
    "fuzz-foreign": "10,000 mutated torchtitan, Megatron-LM and Hugging Face checkpoints (500 "
                    "in CI) through `hpctrain import`: the same model or one refusal, nothing "
                    "written outside, no process, no import, no hang",
    "interchange": "peak memory of every import and export, against its bound",
}


def parts() -> list[str]:
    """Each part with its world sizes and what it compares."""
    from . import BENCHES

    assert set(PARTS) == set(BENCHES), "describe each part of BENCHES in PARTS"
    return ["|part|ranks|compares|", "|---|---|---|",
            *(f"|{name}|{', '.join(map(str, ranks))}|{PARTS[name]}|"
              for name, ranks in BENCHES.items())]


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _median(r: dict) -> str:
    return _fmt(r["median"], r["unit"]) if r.get("median") is not None else ""


def _ratio(q: dict) -> str:
    cell = f"{q['name']} = {q['value']:.3g}"
    if q.get("spread"):
        lo, hi = q["spread"]
        cell += f" [{lo:.3g}-{hi:.3g}]" + (" noise" if q.get("noise") else "")
    return cell


def _met(q: dict) -> str:
    return "" if q.get("met") is None else ("yes" if q["met"] else "**no**")


def _run_table(results: list[dict]) -> list[str]:
    out = ["|part|ranks|variant|median|ratio [spread]|target|met|same result|load|",
           "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "error" in res:
            out.append(f"|{res['bench']}|{res.get('ranks', '?')}|FAILED: "
                       f"{_cell(res['error'][:80])}|||||||")
            continue
        rows, ratios = res.get("rows", []), res.get("ratios", [])
        for i in range(max(len(rows), len(ratios))):
            r = rows[i] if i < len(rows) else {}
            q = ratios[i] if i < len(ratios) else None
            first = i == 0
            cells = [res["bench"] if first else "", str(res["ranks"]) if first else "",
                     r.get("variant", ""), _median(r) if r else "", _ratio(q) if q else "",
                     (q.get("target") or "") if q else "", _met(q) if q else "",
                     _check(res) if first else "", _load(res) if first else ""]
            out.append("|" + "|".join(_cell(c) for c in cells) + "|")
    return out


def _step_table(res: dict) -> list[str]:
    """A part's per-variant step, exposed communication and the plan's prediction."""
    def ms(x):
        return "" if x is None else f"{x * 1e3:.0f} ms"

    out = ["", f"{res['bench']}: median step, exposed communication, the plan's prediction:",
           "",
           "|variant|step|exposed communication|predicted|", "|---|---|---|---|"]
    out += [f"|{_cell(t['variant'])}|{ms(t['step_s'])}|{ms(t.get('exposed_comm_s'))}|"
            f"{ms(t.get('predicted_s'))}|" for t in res["table"]]
    return out


def _machine(m: dict) -> str:
    parts_ = [m.get("host"), f"{m['cpus']} CPUs" if m.get("cpus") else None,
              m.get("platform"), f"torch {m['torch']}" if m.get("torch") else None,
              m.get("mpi")]
    return ", ".join(p for p in parts_ if p)


def _command(doc: dict) -> str:
    from . import BENCHES

    names = list(dict.fromkeys(r["bench"] for r in doc["results"]))
    only = "" if set(names) == set(BENCHES) else "".join(f" --only {n}" for n in names)
    return (f"python -m benchmarks --out DIR{only} --size {doc.get('size', 'small')} "
            f"--repeats {doc.get('repeats', 5)}")


def run_section(doc: dict) -> list[str]:
    """One recorded run: when, where, the command, every row and ratio, what was missed and
    why, and the extra tables (steps per variant, collectives)."""
    results = doc["results"]
    names = ", ".join(dict.fromkeys(r["bench"] for r in results))
    out = [f"## {names} ({doc['meta']['date']})", "",
           f"On {_machine(doc['meta'])}: `{_command(doc)}`."]
    if doc.get("note"):
        out += ["", doc["note"]]
    stepped = [r for r in results if r.get("table") and "step_s" in r["table"][0]]
    shown = [r if r not in stepped else {**r, "rows": []}  # their steps: the table below
             for r in results if r.get("bench") != "collectives"]
    out += ["", *_run_table(shown)]
    missed = [(r, q) for r in results for q in r.get("ratios", [])
              if q.get("met") is False and (q.get("why") or q.get("noise"))]
    if missed:
        out += ["", "Not met, and why:", ""]
        out += [f"- {r['bench']} ({r['ranks']} rank{'s' * (r['ranks'] != 1)}), "
                f"{q['name']}: {reason(q)}" for r, q in missed]
    for r in stepped:
        out += _step_table(r)
    for r in results:
        if r.get("bench") == "collectives" and r.get("table"):
            out += ["", f"Collectives ({r.get('what', '')}):", "",
                    *(line.replace(" | ", "|") for line in collectives_table(r))]
    return out + [""]


def reason(q: dict) -> str:
    """Why a recorded ratio missed: noise when its pairs cover 1.0 (the measured breakdown
    says nothing then), else the part's measured reason."""
    if q.get("noise"):
        lo, hi = q["spread"]
        return f"noise ({q['pairs']} pairs span {lo:.2f}-{hi:.2f})"
    return q.get("why") or "noise"


def page(runs) -> str:
    """docs/benchmarks.md from recorded runs: a bench.json document, or a list of them
    (newest first)."""
    runs = runs if isinstance(runs, list) else [runs]
    out = [PREAMBLE, *parts(), ""]
    for doc in runs:
        out += run_section(doc)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit(f"usage: {REGENERATE}")
    sys.stdout.write(page(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
