"""The fuzz campaign's judge (benchmarks/fuzz_foreign.py, fuzz_worker.py) sees what it claims
to see, so that a campaign with no violation means something: a change of the sentinel tree
that keeps sizes and mtimes, writes, removals and process starts outside the scratch
directory (refused and recorded by the audit hook), reads outside the checkpoint, a class
changed process-wide, and every way a conversion may end."""

import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import fuzz_foreign as ff
from benchmarks import fuzz_worker as fw

ROOT = Path(__file__).resolve().parents[2]


def result(**kw):
    base = {"rc": 2, "exception": None, "seen": [], "modules": [], "state": [],
            "stderr": "hpctrain import: x is not a DCP checkpoint\n", "out_exists": False}
    return {**base, **kw}


@pytest.mark.parametrize("res, kinds", [
    (result(), []),
    (result(rc=0, model={"same": True}, stderr=""), []),
    (result(rc=0, model={"same": False, "what": "2 model datasets differ"}, stderr=""),
     ["imported other weights (exit 0)"]),
    (result(rc=None, exception="Traceback ...\nKeyError: 'x'"), ["traceback"]),
    (result(rc=1, stderr="boom\n"), ["exit status other than 0 or 2"]),
    (result(stderr="hpctrain import: a\nhpctrain import: b\n"), ["refusal not one message"]),
    (result(stderr="Traceback (most recent call last):\nValueError\n"), ["traceback"]),
    (result(out_exists=True), ["failed but left output behind"]),
    (result(rc=None, exception="Traceback ...\nCheckpointException", out_exists=True),
     ["traceback", "failed but left output behind"]),
    (result(seen=[["write", "os.remove /x"], ["process", "os.system touch"],
                  ["read", "/etc/passwd"], ["import", "antigravity"]], modules=["antigravity"]),
     ["wrote outside the scratch directory", "started a process",
      "read a file outside the checkpoint", "imported a module outside the admitted list"]),
    (result(state=["pathlib.PosixPath._str"]), ["changed a class or global process-wide"]),
    ({"hang": True, "after": "conversion"}, ["hang"]),
    ({"died": "signal 11"}, ["crash"]),
])
def test_every_way_a_case_ends_is_judged(res, kinds):
    assert [k for k, _ in ff.violations(res, [])] == kinds


def test_outside_changes_are_violations():
    found = ff.violations(result(), ["sentinel: changed victim.txt"])
    assert found == [("wrote outside the scratch directory", "sentinel: changed victim.txt")]


def test_sentinel_snapshot_sees_content_behind_the_same_size_and_mtime(tmp_path):
    (tmp_path / "a").write_bytes(b"0123")
    (tmp_path / "d").mkdir()
    before = ff.snapshot(tmp_path)
    st = os.stat(tmp_path / "a")
    (tmp_path / "a").write_bytes(b"3210")
    os.utime(tmp_path / "a", ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "d" / "new").write_text("x")
    assert ff.differences(before, ff.snapshot(tmp_path)) == ["created d/new", "changed a",
                                                             "changed d"]


def test_a_class_changed_through_a_name_in_the_file_is_seen():
    mod = types.ModuleType("fuzz_probe")
    mod.Target = type("Target", (), {"x": 1})
    mod.sub = types.ModuleType("fuzz_probe_sub")
    mod.sub.value = 1
    sys.modules.update({"fuzz_probe": mod, "fuzz_probe_sub": mod.sub})
    try:
        before = {"fuzz_probe": fw.module_state(mod), "fuzz_probe_sub": fw.module_state(mod.sub)}
        named = {"Target", "sub", "value"}  # BUILD's state names its keys in the file too
        assert fw.state_changes(before, frozenset(), {"fuzz_probe"}, named) == []
        mod.Target._str = "/victim"  # what BUILD on the class does
        mod.sub.value = 2  # BUILD on a module reached as an attribute
        assert fw.state_changes(before, frozenset(), {"fuzz_probe"}, named) == [
            "fuzz_probe.Target._str", "fuzz_probe_sub.value"]
        assert fw.state_changes(before, frozenset({"fuzz_probe.Target._str"}), {"fuzz_probe"},
                                {"Target"}) == []
    finally:
        del sys.modules["fuzz_probe"], sys.modules["fuzz_probe_sub"]


def test_names_a_pickle_can_reach_are_read_from_it_and_from_zip_records(tmp_path):
    import pathlib

    import torch

    (tmp_path / "m").write_bytes(pickle.dumps([pathlib.PosixPath, torch.Size([1])], 2))
    torch.save({"a": pathlib.PurePosixPath("/x")}, tmp_path / "z.pt")
    modules, words = fw.names_in([tmp_path / "m", tmp_path / "z.pt", tmp_path / "absent"])
    assert {"pathlib", "torch"} <= modules and {"PosixPath", "Size", "PurePosixPath"} <= words


PROBE = """
import json, os, subprocess, sys
sys.path.insert(0, {root!r})
from benchmarks.fuzz_worker import WATCH
scratch, outside = sys.argv[1], sys.argv[2]
sys.addaudithook(WATCH.hook)
WATCH.arm("check", scratch, scratch)
refused = []
for name, act in [("write", lambda: open(os.path.join(outside, "new"), "w")),
                  ("remove", lambda: os.remove(os.path.join(outside, "keep"))),
                  ("rename", lambda: os.rename(os.path.join(scratch, "f"),
                                               os.path.join(outside, "moved"))),
                  ("process", lambda: subprocess.run(["true"])),
                  ("system", lambda: os.system("true"))]:
    try:
        act()
    except PermissionError:
        refused.append(name)
open(os.path.join(scratch, "inside"), "w").write("ok")
open(os.path.join(outside, "keep")).read()
WATCH.mode = "off"
print(json.dumps({{"refused": refused, "seen": WATCH.seen}}))
"""


def test_audit_hook_refuses_and_records_what_reaches_outside(tmp_path):
    scratch, outside = tmp_path / "case", tmp_path / "sentinel"
    scratch.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("x")
    (scratch / "f").write_text("y")
    proc = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT)), str(scratch),
                           str(outside)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["refused"] == ["write", "remove", "rename", "process", "system"]
    kinds = [k for k, _ in out["seen"]]
    assert kinds.count("write") == 3 and kinds.count("process") == 2, out
    assert ["read", str(outside / "keep")] in out["seen"]
    assert (outside / "keep").exists() and (scratch / "inside").read_text() == "ok"
    assert not (outside / "new").exists() and not (outside / "moved").exists()
