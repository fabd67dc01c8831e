"""The architecture's import rules (docs/design.md, "Packages and their imports"), checked on
the source with ``ast`` (no MPI, nothing imported): who may import whom inside hpctrain, and
no import cycles between modules."""

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hpctrain"

# Each unit of the architecture (a package, or a top-level module) and the units it may
# import. Anything not listed as allowed is forbidden; a unit always may import itself.
ALLOWED = {
    "config": set(),
    "comm": set(),
    # the fault injector (tests, fault campaigns): standard library only
    "faults": set(),
    # starting ranks, the relaunch loop, the SLURM job: standard library + comm
    "job": {"comm"},
    "model": {"config"},
    "topology": {"comm", "config"},
    # schedules as data, stage placement, the runner: below parallel, which places by them
    "pipeline": {"comm", "config", "model"},
    "parallel": {"comm", "config", "model", "pipeline", "topology"},
    "optim": {"comm", "config", "parallel"},
    "checkpoint": {"comm", "config", "faults", "model"},
    "telemetry": {"comm", "config", "faults", "model", "parallel", "topology"},
    "data": set(),
    "checks": {"config", "data", "faults", "interchange", "model", "parallel", "pipeline"},
    "evaluate": {"data", "pipeline"},
    "interchange": {"checkpoint", "config", "data", "model"},
    "stopping": {"job"},
    "train": {"checkpoint", "checks", "comm", "config", "data", "evaluate", "interchange",
              "job", "optim", "parallel", "pipeline", "planner", "stopping", "telemetry",
              "topology"},
    # the performance model: pure Python except planner/calibrate.py, which measures through comm
    "planner": {"checks", "comm", "config", "job", "model", "parallel", "pipeline",
                "telemetry", "topology"},
    "cli": {"checkpoint", "checks", "comm", "config", "data", "interchange", "job", "model",
            "telemetry", "topology", "train", "parallel", "pipeline", "planner"},
    "__main__": {"cli"},
    "__init__": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(src: str, name: str, is_package: bool) -> set[str]:
    """Absolute names of the hpctrain modules (or their attributes) that the source of module
    ``name`` imports, anywhere in it (function-level imports count too)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "hpctrain"}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "hpctrain":
                continue
            if node.module:  # "from . import x" needs x, not the package being initialised
                out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
    return out


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The module a dotted name refers to (``hpctrain.comm.Group`` -> ``hpctrain.comm``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.lru_cache(maxsize=1)
def edges() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for name, path in MODULES.items():
        for target in imports_of(path):
            mod = resolve(target)
            if mod is not None and mod != name:
                graph[name].add(mod)
    return graph


def test_every_unit_has_a_rule():
    units = {unit(m) for m in MODULES}
    assert units <= set(ALLOWED), f"no import rule for {sorted(units - set(ALLOWED))}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_allowed_imports(name):
    here = unit(name)
    bad = sorted(t for t in edges().get(name, ()) if unit(t) != here
                 and unit(t) not in ALLOWED[here] and t != "hpctrain")
    assert not bad, f"{name} may not import {bad} (allowed: {sorted(ALLOWED[here])})"


def test_rules_that_define_the_architecture():
    """The lines docs/design.md draws: config is plain data; the model knows no MPI; comm is
    the bottom of the stack."""
    assert ALLOWED["config"] == set()
    assert ALLOWED["model"] == {"config"}
    assert not ALLOWED["comm"] & {"parallel", "pipeline", "model"}
    for name, path in MODULES.items():
        if unit(name) == "model":
            assert "mpi4py" not in path.read_text(), f"{name} mentions mpi4py"


def test_no_import_cycles():
    graph = edges()
    state: dict[str, int] = {}  # 1 on the stack, 2 finished
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


def test_the_checker_sees_a_forbidden_import():
    """The rule check can fail: an import of comm added to the model is found and refused."""
    src = (ROOT / "model" / "stage.py").read_text() + "\nfrom ..comm import Group\n"
    found = {resolve(t) for t in imports_in(src, "hpctrain.model.stage", False)}
    assert "hpctrain.comm" in found
    assert unit("hpctrain.comm") not in ALLOWED["model"]
