"""The streamed safetensors writer (hpctrain/interchange/safetensors_file.py) writes the
bytes the safetensors library itself writes, block by block, and leaves nothing behind when
a block fails."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hpctrain.interchange.safetensors_file import Planned, write_file


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(7, 5, generator=g).bfloat16(),  # 70 bytes: odd offsets
            "a.bias": torch.randn(3, generator=g, dtype=torch.float64),
            "z": torch.randn(6, 3, generator=g),
            "h": torch.randn(5, generator=g).half(),
            "scalar": torch.tensor(2.5)}


def planned(ts: dict, rows: int = 2) -> list[Planned]:
    """Each tensor as blocks of ``rows`` rows, numpy where numpy has the dtype."""
    def blocks(t):
        if t.dim() == 0:
            yield t
            return
        for start in range(0, len(t), rows):
            part = t[start:start + rows]
            yield part.numpy() if t.dtype != torch.bfloat16 else part

    return [Planned(k, t.dtype, tuple(t.shape), lambda t=t: blocks(t)) for k, t in ts.items()]


def test_streamed_file_is_the_librarys_own(tmp_path):
    ts = tensors()
    save_file(ts, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    write_file(tmp_path / "ours.safetensors", planned(ts), {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == \
        (tmp_path / "lib.safetensors").read_bytes()
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(ts)
        for k, t in ts.items():
            assert torch.equal(f.get_tensor(k), t), k
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failing_or_short_tensor_leaves_no_file(tmp_path):
    def broken():
        yield np.zeros(4, np.float32)
        raise OSError("disk gone")

    out = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match="disk gone"):
        write_file(out, [Planned("t", torch.float32, (8,), broken)], {})
    short = Planned("t", torch.float32, (8,), lambda: iter([np.zeros(4, np.float32)]))
    with pytest.raises(ValueError, match="16 bytes written, 32 announced"):
        write_file(out, [short], {})
    assert list(tmp_path.iterdir()) == []
