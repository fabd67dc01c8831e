"""Blending two prepared corpora in one launch (float64): one rank is the reference, dp=2
trains the 6 steps straight and tp=2 resumes dp=2's checkpoint at step 2; losses, grad norms,
the blended and per-source held-out losses and the final parameters agree within 1e-9.
Document masks stay on (each source's own document starts). `hpctrain plan` counts each
source's epochs. A blend with a missing source is refused through the CLI
(tests/e2e/test_data_cli.py)."""

import json

import h5py
import pytest
from inprocess import baseline, on_root, train_layout
from launch import TINY, assert_same, assert_tail_equal, ckpt, hpctrain, rel_err

from hpctrain.data.blend import BlendOrder

PROSE = "the quick brown fox jumps over the lazy dog while {} birds sing in tree {}. "
CODE = "def f{}(x):\n    return x * {} + {}\n"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two byte-level corpora of different text, prepared from JSONL by `hpctrain prepare`:
    prose (141 samples of 17 tokens per epoch) and code (20)."""
    root = tmp_path_factory.mktemp("blend")
    out = []
    for name, docs in (("prose", [PROSE.format(i, i * 7) * 2 for i in range(20)]),
                       ("code", [CODE.format(i, i + 1, i * 3) for i in range(14)])):
        src = root / f"{name}.jsonl"
        on_root(src.write_text, "".join(json.dumps({"text": d}) + "\n" for d in docs))
        path = root / f"{name}.h5"
        on_root(hpctrain, ["prepare", str(src), "--val-fraction", "0.3", "--out", str(path)])
        out.append(str(path))
    return out


@pytest.mark.slow(reason="two corpora prepared, three runs with evaluation per source")
def test_a_blend_on_any_layout_and_resumed_on_another(tmp_path, session_dir, corpora):
    prose, code = corpora
    blend = f'data.sources=[{{path="{prose}", weight=0.7}}, {{path="{code}", weight=0.3}}]'
    common = (blend, "data.document_mask=true", "train.steps=6", "checkpoint.every=2",
              "train.eval_every=3")
    ref = baseline(session_dir, *common)
    a = train_layout(tmp_path / "dp2", 2, *common, "topology.dp=2")
    assert_same(a, ref, rel=1e-9, what="a blend on dp=2")
    b = train_layout(tmp_path / "tp2", 2, *common, "topology.tp=2",
                  f"checkpoint.resume={ckpt(a, 2)}")
    assert_tail_equal(b, ref, 2, "a blend: dp=2 step 2 -> tp=2")
    for key in ("val_loss", "val_loss/prose", "val_loss/code"):
        val = [[m[key] for m in r.metrics if key in m] for r in (ref, a, b)]  # steps 3, 6
        assert [len(v) for v in val] == [2, 2, 2], (key, val)
        assert rel_err(val[1], val[0]) <= 1e-9 and rel_err(val[2], val[0]) <= 1e-9, (key, val)
    assert ref.metrics[-1]["val_loss/prose"] != ref.metrics[-1]["val_loss/code"]

    # Each source's epoch and position, recorded in the checkpoint and shown by inspect;
    # `hpctrain plan` counts the epochs the same way.
    ns = []
    for path in corpora:
        with h5py.File(path, "r") as f:
            ns.append((f["train/tokens"].shape[0] - 1) // 16)
    counts = BlendOrder([0.7, 0.3]).counts(6 * 16)  # 96 samples, 67 prose and 29 code
    assert f"{ns[0]} + {ns[1]} samples per epoch" in ref.stdout
    with h5py.File(ckpt(b, 6), "r") as f:
        pos = json.loads(f.attrs["blend_position"])
        recorded = json.loads(json.loads(f.attrs["lineage"])["data"]["blend"])
    assert [r["path"] for r in recorded] == corpora and [r["weight"] for r in recorded] == \
        [0.7, 0.3]
    assert [(p["source"], p["epoch"], p["epoch_position"]) for p in pos] == \
        [(name, int(c) // n, int(c) % n) for name, c, n in zip(("prose", "code"), counts, ns)]
    assert pos[1]["epoch"] >= 1, (pos, ns)  # code crossed an epoch boundary
    shown = on_root(lambda: hpctrain(["inspect", str(ckpt(b, 6))]).stdout)
    assert "blend_position" in shown and '"source": "code"' in shown, shown
    plan = on_root(lambda: hpctrain(["plan", TINY, "--world-size", "1", "--set", blend,
                                     "--set", "train.steps=6"]).stdout)
    want = (f"this run covers {counts[0] / ns[0]:.3g} epochs of prose, "
            f"{counts[1] / ns[1]:.3g} of code")
    assert want in plan, plan

