"""Foreign checkpoints are data, never code (interchange/pickles.py): a DCP ``.metadata``
or a ``common.pt`` crafted to run a command when unpickled, or to change a class process-wide
(BUILD on a class, items added to a non-container), is refused, naming the file and what it
asked for, and nothing runs or changes; torch's own DCP reader would run it. What real
writers put there reads: Megatron-LM's ``args`` (a Namespace holding Megatron's enums and
torch dtypes) as plain data without importing Megatron, and a DCP written under Python
3.13, whose paths pickle as ``pathlib._local.PosixPath``."""

import argparse
import contextlib
import io
import os
import pathlib
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.__main__ import main
from hpctrain.interchange import pickles
from hpctrain.interchange.hf_map import InterchangeError

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny-llama.toml")


class Payload:
    """Unpickling it runs ``touch MARKER`` (``os.system`` pickles as ``posix.system``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def real_dcp(directory):
    dcp.save({"tok_embeddings.weight": torch.ones(4, 2)},
             storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)


def crafted(directory, marker, inside: bool):
    """A DCP directory whose .metadata runs the payload: as the whole pickle, or hidden in
    an otherwise real Metadata (its planner_data)."""
    real_dcp(directory)
    meta = pickles.load_dcp_metadata(directory / ".metadata")
    if inside:
        meta.planner_data = {"tok_embeddings.weight": Payload(marker)}
        obj = meta
    else:
        obj = Payload(marker)
    (directory / ".metadata").write_bytes(pickle.dumps(obj))


@pytest.mark.parametrize("inside", [False, True], ids=["whole", "inside-metadata"])
def test_crafted_metadata_is_refused_without_running(tmp_path, capsys, inside):
    marker = tmp_path / "ran"
    crafted(tmp_path / "d", marker, inside)
    rc = main(["import", "--format", "dcp", str(tmp_path / "d"), "--config", TINY,
               "--out", str(tmp_path / "out.h5")])
    err = capsys.readouterr().err
    assert rc == 2 and not marker.exists() and not (tmp_path / "out.h5").exists()
    assert f"{tmp_path / 'd' / '.metadata'}" in err and "system" in err and "refused" in err
    # the threat is real: torch's own reader runs it (then finds no Metadata, when whole)
    with contextlib.suppress(AttributeError):
        dcp.FileSystemReader(str(tmp_path / "d")).read_metadata()
    assert marker.exists()


def test_real_metadata_reads(tmp_path):
    real_dcp(tmp_path)
    meta = pickles.load_dcp_metadata(tmp_path / ".metadata")
    assert tuple(meta.state_dict_metadata["tok_embeddings.weight"].size) == (4, 2)


def test_damaged_metadata_is_one_message(tmp_path):
    real_dcp(tmp_path)
    (tmp_path / ".metadata").write_bytes((tmp_path / ".metadata").read_bytes()[:40])
    with pytest.raises(InterchangeError, match="not a readable DCP metadata file"):
        pickles.load_dcp_metadata(tmp_path / ".metadata")


def test_crafted_common_pt_is_refused(tmp_path):
    """Megatron's common.pt is read as data: plain data reads, a payload is refused."""
    marker = tmp_path / "ran"
    torch.save({"iteration": 7, "w": torch.ones(2)}, tmp_path / "ok.pt")
    assert pickles.load_torch_data(tmp_path / "ok.pt", "ok.pt")["iteration"] == 7
    torch.save({"args": Payload(marker)}, tmp_path / "common.pt")
    with pytest.raises(pickles.UnsafePickle, match="common.pt"):
        pickles.load_torch_data(tmp_path / "common.pt", str(tmp_path / "common.pt"))
    assert not marker.exists()


def dcp_import(tmp_path, directory):
    return main(["import", "--format", "dcp", str(directory), "--config", TINY,
                 "--out", str(tmp_path / "out.h5")])


def op_global(module: str, name: str) -> bytes:
    """Pickle opcodes pushing ``module.name`` (SHORT_BINUNICODE x2, STACK_GLOBAL)."""
    return (b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)])
            + name.encode() + b"\x93")


def op_str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def prefixed(real: bytes, prefix: bytes) -> bytes:
    """``prefix`` run (its result popped) before the real pickle: PROTO, prefix, POP, rest."""
    assert real[:2] == b"\x80\x04"
    return real[:2] + prefix + b"0" + real[2:]


GADGETS = {
    # the attack of the issue: BUILD on an admitted class sets attributes process-wide
    # (state None, slot state {...}: set as attributes, as the attack set PosixPath._str)
    "build-on-class": op_global("pathlib", "PosixPath") + b"N}" + op_str("hpctrain_probe")
    + op_str("set") + b"s\x86b",
    # the same through a memo entry: the class memoised, fetched again, then BUILD
    "build-on-memoised-class": op_global("pathlib", "PosixPath") + b"\x94" + b"0" + b"h\x00"
    + b"N}" + op_str("hpctrain_probe") + op_str("set") + b"s\x86b",
    # SETITEM on a class (not a dict)
    "setitem-on-class": op_global("collections", "OrderedDict") + op_str("hpctrain_probe")
    + op_str("set") + b"s",
    # APPEND on a class (not a list)
    "append-on-class": op_global("torch", "Size") + op_str("set") + b"a",
    # a protocol-0 instance of an admitted class
    "inst-opcode": b"(ipathlib\nPosixPath\n",
    # an extension code
    "extension-code": b"\x82\x01",
}


@pytest.mark.parametrize("gadget", sorted(GADGETS))
def test_gadgets_change_nothing_and_are_refused(tmp_path, capsys, gadget):
    """Each gadget, run before a real Metadata, is refused by name (opcode or global) with
    exit 2; no class of the process gained an attribute. On the code before the strict
    interpreter, BUILD on PosixPath set ``PosixPath.hpctrain_probe``."""
    real_dcp(tmp_path / "d")
    meta = tmp_path / "d" / ".metadata"
    meta.write_bytes(prefixed(pickle.dumps(pickles.load_dcp_metadata(meta), protocol=4),
                              GADGETS[gadget]))
    rc = dcp_import(tmp_path, tmp_path / "d")
    err = capsys.readouterr().err
    probes = [c for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path,
                          torch.Size, __import__("collections").OrderedDict)
              if "hpctrain_probe" in vars(c)]
    assert not probes and rc == 2 and not (tmp_path / "out.h5").exists(), (probes, err)
    assert str(meta) in err and "refused" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_refusals_name_the_opcode(tmp_path):
    real_dcp(tmp_path)
    meta = pickle.dumps(pickles.load_dcp_metadata(tmp_path / ".metadata"), protocol=4)
    for gadget, word in (("build-on-class", "BUILD"), ("setitem-on-class", "SETITEM"),
                         ("append-on-class", "APPEND"), ("inst-opcode", "INST")):
        with pytest.raises(pickles.UnsafePickle, match=word):
            pickles.DataUnpickler(io.BytesIO(prefixed(meta, GADGETS[gadget])), "m").load()


MEGATRON_ARGS = """
import argparse, sys, torch
from megatron.core.transformer.enums import AttnBackend
args = argparse.Namespace(attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16,
                          rotary_interleaved=False, make_vocab_size_divisible_by=128,
                          tensor_model_parallel_size=2, num_layers=2)
torch.save({"args": args, "iteration": 11, "checkpoint_version": 3.0}, sys.argv[1])
"""


def test_megatron_args_with_enums_read_as_data(tmp_path):
    """Megatron-LM's args hold enums (``--attention-backend``'s default AttnBackend.auto):
    written by Megatron-Core's own enum class in another process, read here as a Record
    (class name and value) beside the plain values, and Megatron is never imported. The
    reader before refused the whole file."""
    path = tmp_path / "common.pt"
    subprocess.run([sys.executable, "-c", MEGATRON_ARGS, str(path)], check=True, timeout=120)
    before = {m for m in sys.modules if m.startswith("megatron")}
    state = pickles.load_torch_data(path, str(path))
    args = state["args"]
    assert state["iteration"] == 11 and args.params_dtype is torch.bfloat16
    assert args.tensor_model_parallel_size == 2 and args.rotary_interleaved is False
    backend = args.attention_backend
    assert isinstance(backend, pickles.Record) and backend._args == (5,)
    assert backend._class == "megatron.core.transformer.enums.AttnBackend"
    assert {m for m in sys.modules if m.startswith("megatron")} == before


def test_python_313_paths_read_as_pure_paths(tmp_path, monkeypatch):
    """Under Python 3.13 a DCP's StorageMeta.checkpoint_id pickles as
    ``pathlib._local.PosixPath``: read as a pure path (no filesystem methods). Made here by
    pickling a class that names itself so, as 3.13's does."""
    real_dcp(tmp_path)
    meta = pickles.load_dcp_metadata(tmp_path / ".metadata")
    local = types.ModuleType("pathlib._local")

    class PosixPath(pathlib.PurePosixPath):
        __module__ = "pathlib._local"
        __qualname__ = "PosixPath"

    local.PosixPath = PosixPath
    monkeypatch.setitem(sys.modules, "pathlib._local", local)
    meta.storage_meta.checkpoint_id = PosixPath("/where/it/was/written")
    data = pickle.dumps(meta)
    monkeypatch.delitem(sys.modules, "pathlib._local")
    assert b"pathlib._local" in data
    (tmp_path / ".metadata").write_bytes(data)
    back = pickles.load_dcp_metadata(tmp_path / ".metadata")
    assert back.storage_meta.checkpoint_id == pathlib.PurePosixPath("/where/it/was/written")
    assert type(back.storage_meta.checkpoint_id) is pathlib.PurePosixPath


def test_namespace_args_are_records_not_namespaces(tmp_path):
    """argparse.Namespace is read as a Record (attributes kept), not constructed."""
    torch.save({"args": argparse.Namespace(num_layers=3)}, tmp_path / "c.pt")
    args = pickles.load_torch_data(tmp_path / "c.pt", "c.pt")["args"]
    assert isinstance(args, pickles.Record) and args.num_layers == 3
    assert args._class == "argparse.Namespace"
