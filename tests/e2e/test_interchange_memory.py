"""Every conversion streams tensor by tensor (docs/interchange.md): what ``hpctrain import``
and ``hpctrain export`` add to a process's resident memory, in each format and direction,
stays within twice the largest tensor plus a margin, on a float32 model of four times that
(64 MiB embedding and head, 16 MiB matrices, two layers: 256 MiB of parameters, three times
that with the moments), so that holding the model, or a parameter with its two moments, is
refused. Each conversion is the real CLI in a fresh process: its peak (VmHWM) minus its
resident memory once the modules a conversion uses are imported (``benchmarks.interchange``,
which measures the same on Llama-3-8B's shapes). The DCP files are float32, as torchtitan
writes them: its reader holds a chunk and its destination at once, the worst case."""

import pytest

from benchmarks.interchange import generate, measure, model_config

pytestmark = pytest.mark.e2e

SHAPES = dict(vocab_size=16384, d_model=1024, n_heads=8, n_kv_heads=8, d_ff=4096, n_layers=2)
MIB = 2**20
MARGIN_MIB = 48  # allocator slack, HDF5 and DCP bookkeeping, 16 MiB blocks in flight


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(directory with a float32 checkpoint ``a.h5`` with moments at step 1, its config
    ``model.toml`` and, made from it in this process, the Hugging Face directory ``hf`` and
    the DCP ``dcp`` with the moments; the largest tensor's bytes)."""
    from hpctrain.config import dumps_toml
    from hpctrain.interchange.hf_export import export_hf
    from hpctrain.interchange.trainers import export_dcp

    d = tmp_path_factory.mktemp("memory")
    cfg = model_config(**SHAPES)
    (d / "model.toml").write_text(dumps_toml(cfg))
    largest = generate(d / "a.h5", cfg)
    export_hf(d / "a.h5", d / "hf", "float32", say=lambda _: None)
    export_dcp(d / "a.h5", d / "dcp", "float32", say=lambda _: None)
    return d, largest


CONVERSIONS = {
    "export safetensors": ("export", "{d}/a.h5", "--format", "safetensors", "--out",
                           "{d}/out.safetensors"),
    "export hf": ("export", "{d}/a.h5", "--format", "hf", "--dtype", "float32", "--out",
                  "{d}/out_hf"),
    "export dcp": ("export", "{d}/a.h5", "--format", "dcp", "--dtype", "bfloat16", "--out",
                   "{d}/out_dcp"),
    "import hf": ("import", "{d}/hf", "--out", "{d}/hf.h5"),
    "import dcp": ("import", "--format", "dcp", "{d}/dcp", "--config", "{d}/model.toml",
                   "--out", "{d}/dcp.h5"),
}


@pytest.mark.parametrize("what", sorted(CONVERSIONS))
def test_conversion_holds_at_most_two_tensors(made, what):
    d, largest = made
    got = measure([a.format(d=d) for a in CONVERSIONS[what]])
    added = got["peak_mib"] - got["base_mib"]
    bound = 2 * largest / MIB + MARGIN_MIB
    assert added <= bound, (f"{what} added {added:.0f} MiB to its process: more than twice "
                            f"the largest tensor ({largest / MIB:.0f} MiB) + {MARGIN_MIB} MiB")
