"""Foreign checkpoints are data, never code (interchange/pickles.py): a DCP ``.metadata``
or a ``common.pt`` crafted to run a command when unpickled is refused, naming the file and
what it asked for, and the command does not run; torch's own DCP reader would run it."""

import contextlib
import os
import pickle
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
    """Megatron's common.pt goes through torch's weights-only unpickler: plain data reads,
    a payload is refused."""
    marker = tmp_path / "ran"
    torch.save({"iteration": 7, "w": torch.ones(2)}, tmp_path / "ok.pt")
    assert pickles.load_torch_data(tmp_path / "ok.pt", "ok.pt")["iteration"] == 7
    torch.save({"args": Payload(marker)}, tmp_path / "common.pt")
    with pytest.raises(pickles.UnsafePickle, match="common.pt"):
        pickles.load_torch_data(tmp_path / "common.pt", str(tmp_path / "common.pt"))
    assert not marker.exists()
