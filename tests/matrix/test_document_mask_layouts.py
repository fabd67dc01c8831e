"""Invariant 1 with ``data.document_mask = true`` in one launch (float64, 5 steps, with
held-out evaluation): attention kept inside documents and positions restarted at each one
train the same model on combined layouts as on one rank: tp x pp (interleaved, sequence
parallel), cp x dp with ZeRO-3 (ring attention with masks), pp x dp (zbv), experts with the
overlapped exchange executor, and the gpt form (no positions) on cp x tp. The data is a
prepared file of short documents (byte-level, 5 to 40 tokens), so nearly every 16-token window
holds a boundary. A file without ``doc_starts`` is refused through the CLI
(tests/e2e/test_data_cli.py)."""

import pytest
from inprocess import baseline, on_root, train_layout
from launch import TINY, TINY_GPT, assert_same, hpctrain

MASK = ("data.document_mask=true", "train.eval_every=5")
MOE = ("model.num_experts=4", "model.moe_every=2")
HALF = "train.micro_batch_size=4"

# (name, ranks, overrides, one-rank reference overrides, config)
LAYOUTS = [
    ("tp2xpp2-interleaved-sp", 4, ["topology.tp=2", "topology.pp=2", "schedule.kind=interleaved",
                                   "schedule.virtual_stages=2",
                                   "topology.sequence_parallel=true"], [], TINY),
    ("cp2xdp2-zero3", 4, ["topology.cp=2", "topology.dp=2", HALF, "optim.zero=3"], [], TINY),
    ("pp2xdp2-zbv", 4, ["topology.pp=2", "topology.dp=2", "schedule.kind=zbv"], [], TINY),
    # the MoE reference takes the global microbatch (dp * mbs = 2 sequences) at once
    ("ep2xpp2-moe-overlap", 4, [*MOE, "topology.dp=2", "topology.ep=2", "topology.pp=2",
                                "schedule.moe_overlap=true"],
     [*MOE, "train.micro_batch_size=2"], TINY),
    # the gpt form (no positions: the mask alone) over the cp ring with tp
    ("gpt-cp2xtp2", 4, ["topology.cp=2", "topology.tp=2"], [], TINY_GPT),
]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A prepared file of 600 short, distinct documents."""
    return on_root(prepare_documents, tmp_path_factory.mktemp("docs"))


def prepare_documents(root):
    src = root / "src"
    src.mkdir()
    for i in range(600):
        n = 5 + (i * 7919) % 36
        (src / f"d{i:03d}.txt").write_text((f"{i}:" + "abcdefghij"[i % 10] * n)[:n])
    out = root / "docs.h5"
    hpctrain(["prepare", str(src), "--val-fraction", "0.2", "--out", str(out)])
    return out

def data(documents) -> str:
    return f"data.path={str(documents)!r}"


@pytest.mark.parametrize("name,n,overrides,ref,config", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_document_mask_equals_one_rank(tmp_path, session_dir, documents, name, n, overrides,
                                       ref, config):
    reference = baseline(session_dir, *MASK, data(documents), *ref, config=config)
    run = train_layout(tmp_path / name, n, *MASK, data(documents), *overrides, config=config)
    assert_same(run, reference, rel=1e-9, what=name)
    val = [m["val_loss"] for m in run.metrics if "val_loss" in m]
    want = [m["val_loss"] for m in reference.metrics if "val_loss" in m]
    assert val and abs(val[0] - want[0]) <= 1e-9 * abs(want[0]), (val, want)


def test_the_mask_changes_training(tmp_path, session_dir, documents):
    """Masked and unmasked runs of the same data differ (the mask is really applied)."""
    masked = baseline(session_dir, *MASK, data(documents))
    plain = train_layout(tmp_path / "plain", 1, "train.steps=1", data(documents))
    assert abs(plain.losses[0] - masked.losses[0]) > 1e-6 * abs(masked.losses[0])

