"""The generated reference pages equal what their generators make now (docs/commands.md from
the CLI's parser, docs/metrics.md from ``hpctrain.telemetry.fields``, docs/benchmarks.md
from the checked-in docs/bench.json), and every field a record builder of metrics.jsonl or
summary.json writes is declared in ``telemetry.fields``: the builders are read with ``ast``
(most of them need MPI or a checkpoint to run), the ones that run without MPI are run."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpctrain import comm
from hpctrain.telemetry import fields

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hpctrain"


def test_docs_commands_md_is_generated_from_the_parser():
    from hpctrain.__main__ import reference
    from hpctrain.cli.about import REGENERATE

    text = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    assert text == reference(), f"docs/commands.md is stale; regenerate it: {REGENERATE}"


def test_docs_formats_table_is_generated_from_the_registry():
    from hpctrain.interchange import formats

    text = (ROOT / "docs" / "interchange.md").read_text(encoding="utf-8")
    start = text.index("<!-- Generated from interchange/formats.py")
    table = text[text.index("\n", start) + 1:text.index("<!-- end of the generated table")]
    assert table == formats.markdown(), "docs/interchange.md's format table is stale: paste " \
        "formats.markdown() between its markers"


def test_docs_metrics_md_is_generated_from_the_declaration():
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert text == fields.markdown(), \
        f"docs/metrics.md is stale; regenerate it: {fields.REGENERATE}"


def test_docs_benchmarks_md_is_generated_from_bench_json():
    from benchmarks.report import REGENERATE, page

    doc = json.loads((ROOT / "docs" / "bench.json").read_text(encoding="utf-8"))
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert text == page(doc), f"docs/benchmarks.md is stale; regenerate it: {REGENERATE}"


# -- the fields the builders write ------------------------------------------------------------

# (file, function or class, {what holds the record: the prefix of its keys}); "return": the
# dicts returned; "args:NAME": dicts passed to a call of NAME. A class: all its methods.
METRIC_BUILDERS = [
    ("train.py", "train_step", {"return": ""}),
    ("train.py", "end_of_step", {"record": "", "args:end_step": ""}),
    ("optim/numeric_guard.py", "NumericGuard.metrics", {"return": ""}),
    ("optim/adamw.py", "LossScaler.metrics", {"return": ""}),
    ("telemetry/meter.py", "Meter.take", {"return": ""}),
    ("telemetry/metrics.py", "Telemetry.__init__", {"self.run_start": "run_start."}),
    ("telemetry/metrics.py", "Telemetry.end_step", {"record": "", "breakdown": "time_s."}),
    ("telemetry/metrics.py", "Telemetry._stragglers", {"return": ""}),
    ("pipeline/runner.py", "pipeline_metrics", {"return": ""}),
    ("parallel/moe_exchange.py", "step_metrics", {"return": ""}),  # MoeStep.metrics
    ("evaluate.py", "Evaluator.run", {"return": ""}),
    ("checkpoint/checkpointer.py", "Checkpointer", {"self.metrics": "", "metrics": ""}),
    ("checkpoint/write.py", "Writer.write", {"return": ""}),
    ("checkpoint/background.py", "InFlight", {"metrics": "", "return": ""}),
    ("checkpoint/local.py", "LocalWriter.write", {"return": ""}),
    ("checkpoint/local.py", "LocalTier", {"self.metrics": "", "metrics": ""}),
]
SUMMARY_BUILDERS = [
    ("telemetry/summary.py", "RunSummary.result", {"return": ""}),
    ("checkpoint/local.py", "LocalTier.restore", {"self.recovery": "recovery."}),
    ("checkpoint/recover.py", "restore", {"tier.recovery": "recovery."}),
]
# What train_step and end_of_step merge into a record: the builders' method names. A new one
# must be listed in METRIC_BUILDERS (and its fields declared) before it joins this set.
MERGED = {"metrics", "take", "take_metrics", "pipeline_metrics", "run", "end_step"}


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)):
        return f"{base}.{node.attr}"
    return None


def _key(node) -> str | None:
    """A dict key as a pattern: a string, an f-string or ``"prefix" + x`` (``*`` for what
    is computed); None for a key that is a plain expression (a layer, an axis)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _key(node.left)
        return None if left is None else left + "*"
    return None


def _dict_keys(node, prefix: str) -> set[str]:
    """The keys of a dict display (nested displays under ``key.``, ``**`` expansions of
    displays and comprehensions with the same prefix)."""
    out: set[str] = set()
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if k is None:
                out |= _dict_keys(v, prefix)
                continue
            if (name := _key(k)) is not None:
                out.add(prefix + name)
                out |= _dict_keys(v, f"{prefix}{name}.")
    elif isinstance(node, ast.DictComp) and (name := _key(node.key)) is not None:
        out.add(prefix + name)
    elif isinstance(node, ast.IfExp):  # {...} if enabled else {}
        out |= _dict_keys(node.body, prefix) | _dict_keys(node.orelse, prefix)
    return out


def _find(tree: ast.Module, qualname: str):
    node = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def builder_keys(path: str, qualname: str, holders: dict[str, str]) -> set[str]:
    return keys_in((PKG / path).read_text(encoding="utf-8"), qualname, holders)


def keys_in(src: str, qualname: str, holders: dict[str, str]) -> set[str]:
    """Every key the builder ``qualname`` of ``src`` puts into what ``holders`` names."""
    body = _find(ast.parse(src), qualname)
    holders = dict(holders)
    if "return" in holders:  # a returned name, or one expanded into it, holds it too
        for n in ast.walk(body):
            if not isinstance(n, ast.Return):
                continue
            if name := _name(n.value):
                holders.setdefault(name, holders["return"])
            if isinstance(n.value, ast.Dict):
                for k, v in zip(n.value.keys, n.value.values):
                    if k is None and (name := _name(v)):
                        holders.setdefault(name, holders["return"])
    out: set[str] = set()
    for n in ast.walk(body):
        if isinstance(n, ast.Return) and "return" in holders:
            out |= _dict_keys(n.value, holders["return"])
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            flat = [t for tg in targets for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg])]
            values = (n.value.elts if isinstance(n.value, ast.Tuple) and len(n.value.elts) ==
                      len(flat) else [n.value] * len(flat))
            for t, v in zip(flat, values):
                if (name := _name(t)) in holders:
                    out |= _dict_keys(v, holders[name])
                elif isinstance(t, ast.Subscript) and (name := _name(t.value)) in holders:
                    if (k := _key(t.slice)) is not None:
                        out.add(holders[name] + k)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            name = _name(n.func.value)
            if n.func.attr == "update" and name in holders:
                out |= {holders[name] + kw.arg for kw in n.keywords if kw.arg}
                for a in n.args:
                    out |= _dict_keys(a, holders[name])
            if f"args:{n.func.attr}" in holders:
                for a in n.args:
                    out |= _dict_keys(a, holders[f"args:{n.func.attr}"])
    return out


def popped(path: str, qualname: str, holders: dict[str, str]) -> set[str]:
    """Keys the builder takes out of what ``holders`` names (``metrics.pop("path")``)."""
    body = _find(ast.parse((PKG / path).read_text(encoding="utf-8")), qualname)
    return {holders[name] + k for n in ast.walk(body)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "pop" and (name := _name(n.func.value)) in holders
            and n.args and (k := _key(n.args[0])) is not None}


POPPED = set().union(*(popped(*b) for b in METRIC_BUILDERS)) - {"ckpt_async_step"}


def _pattern(name: str) -> str:
    return re.sub(r"<[^>]+>", "*", name)


def undeclared(found: set[str], declared: dict[str, str]) -> list[str]:
    """The keys of ``found`` (``*``: computed) that no declared name (``<x>``: any key)
    covers."""
    names = {_pattern(k) for k in declared}
    rules = [re.compile(re.escape(_pattern(k)).replace(r"\*", r"[^.]+")) for k in declared]
    return sorted(k for k in found
                  if _pattern(k) not in names and not any(r.fullmatch(k) for r in rules))


@pytest.mark.parametrize("path,qualname,holders", METRIC_BUILDERS,
                         ids=[f"{p}:{q}" for p, q, _ in METRIC_BUILDERS])
def test_every_field_a_metrics_builder_writes_is_declared(path, qualname, holders):
    found = builder_keys(path, qualname, holders)
    assert found, f"{qualname}: no field found (moved?)"
    missing = undeclared(found - POPPED, fields.metrics_fields())
    assert not missing, (f"{path}:{qualname} writes {missing}, not declared in "
                         f"hpctrain/telemetry/fields.py; then {fields.REGENERATE}")


@pytest.mark.parametrize("path,qualname,holders", SUMMARY_BUILDERS,
                         ids=[f"{p}:{q}" for p, q, _ in SUMMARY_BUILDERS])
def test_every_field_of_summary_json_is_declared(path, qualname, holders):
    found = builder_keys(path, qualname, holders)
    assert found, f"{qualname}: no field found (moved?)"
    missing = undeclared(found, fields.SUMMARY)
    assert not missing, (f"{path}:{qualname} writes {missing}, not declared in "
                         f"hpctrain/telemetry/fields.py SUMMARY; then {fields.REGENERATE}")


def test_the_builders_merged_into_a_record_are_the_ones_read():
    """train_step and end_of_step build a record from these calls only: a new source of
    fields has to be listed above before its fields count as checked."""
    tree = ast.parse((PKG / "train.py").read_text(encoding="utf-8"))
    calls = set()
    parts = [n.value for n in ast.walk(_find(tree, "train_step"))
             if isinstance(n, ast.Return)]  # the step's record
    for n in ast.walk(_find(tree, "end_of_step")):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "end_step":  # tel.end_step({**record, ...})
                calls.add("end_step")
                parts += n.args
            elif n.func.attr == "update" and _name(n.func.value) == "record":
                calls |= {a.func.attr for a in n.args if isinstance(a, ast.Call)}
    for d in parts:
        assert isinstance(d, ast.Dict)
        calls |= {v.func.attr if isinstance(v.func, ast.Attribute) else v.func.id
                  for k, v in zip(d.keys, d.values) if k is None and isinstance(v, ast.Call)}
    assert calls == MERGED


def test_every_timed_category_is_declared():
    """``timers("NAME")`` anywhere in hpctrain becomes ``time_s.NAME``."""
    names = set()
    for path in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Call) and n.args and (
                    (isinstance(n.func, ast.Name) and n.func.id == "timers") or
                    (isinstance(n.func, ast.Attribute) and n.func.attr == "timers") or
                    (isinstance(n.func, ast.Attribute) and n.func.attr == "add"
                     and _name(n.func.value) in ("timers", "self.timers"))):
                if (k := _key(n.args[0])) is not None:
                    names.add(k if k.startswith("pp_") else f"time_s.{k}")
    assert names, "no timer found"
    names = {"pipeline_s" if k.startswith("pp_") else k for k in names}
    assert not undeclared(names, fields.metrics_fields())


def test_the_extraction_sees_what_a_builder_adds():
    """The reader itself: a new field in any of the forms the builders use is seen."""
    src = textwrap.dedent("""
        def build(record, x):
            out = {"a": 1, "n": {"b": 2}, **{f"c_{x}": 3 for _ in x}}
            out["d"] = 4
            record.update(e=5)
            record.update({"f": 6})
            record["g_" + x] = 7
            return {**out, "h": 8}
    """)
    found = keys_in(src, "build", {"return": ""}) | keys_in(src, "build", {"record": "r."})
    assert found == {"a", "n", "n.b", "c_*", "d", "h", "r.e", "r.f", "r.g_*"}
    assert undeclared({"time_s.comm_*", "val_loss/*", "nope"}, fields.metrics_fields()) == \
        ["nope"]


# -- the builders that run without MPI -------------------------------------------------------

def _flat(record: dict, keyed_by_value=("time_s", "comm_s", "comm_bytes", "moe_load",
                                        "moe_dropped", "pipeline_s")) -> set[str]:
    out = set()
    for k, v in record.items():
        out.add(k)
        if isinstance(v, dict) and k not in keyed_by_value:
            out |= {f"{k}.{inner}" for inner in v}
    return out


def test_a_record_of_the_telemetry_in_process_is_declared(tmp_path):
    """One step through the real Telemetry (one rank, no MPI: a fake world), with the numeric
    guard's and the loss scaler's fields merged as train.py merges them."""
    from fakes import OneRank

    from hpctrain.config import Config
    from hpctrain.optim.adamw import LossScaler
    from hpctrain.optim.numeric_guard import NumericGuard
    from hpctrain.telemetry import RunLog, Telemetry

    cfg = Config()
    world = OneRank()
    topo = SimpleNamespace(world=world, local_rank=0, coords=(0, 0, 0, 0, 0),
                           dims=(1, 1, 1, 1, 1), recorder=comm.Recorder())
    log = RunLog(tmp_path, topo, total_steps=1)
    tel = Telemetry(cfg, topo, tmp_path, log, peak=(1e12, "test"), flops_per_token=1.0)
    guard = NumericGuard(cfg.telemetry)
    guard.admit(float("nan"), 1.0, 1)
    scaler = LossScaler(enabled=True)
    tel.begin_step(1)
    with tel.timers("compute"):
        topo.recorder.complete(topo.recorder.post("allreduce", "dp", -1, 8), 0.0)
    record = tel.end_step({"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                           "data_s": 0.0, **guard.metrics(), "step_time_s": 0.5,
                           **scaler.metrics()})
    tel.close()
    log.close()
    assert {"mfu", "straggler", "run_start", "skip_reason", "loss_scale"} <= set(record)
    assert not undeclared(_flat(record) | {f"time_s.{k}" for k in record["time_s"]},
                          fields.metrics_fields())
    written = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert set(written) == set(record)


def test_summary_json_has_exactly_the_declared_fields(tmp_path):
    from hpctrain.telemetry.summary import RunSummary

    summary = RunSummary(0, 128, {"tier": "none", "step": 0, "recovery_s": 0.1, "path": None,
                                  "reshard": False})
    summary.add({"step": 1, "loss": 2.0, "val_loss": 2.5})
    out = summary.result("finished", None, 1.0)
    top = {k for k in fields.SUMMARY if "." not in k}
    assert set(out) == top
    assert not undeclared(_flat(out), fields.SUMMARY)
