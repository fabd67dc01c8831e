"""``plan --search``'s sbatch line: what it carries, and that a shell gives the template
exactly those arguments, whatever the user's overrides hold (spaces, quotes)."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from launch import TINY

from hpctrain.config import load
from hpctrain.planner import search
from hpctrain.planner.cluster import ClusterError, from_dict
from hpctrain.planner.cluster import load as load_cluster


@pytest.fixture(scope="module")
def best():
    cluster = load_cluster("dgx-a100")
    return search.search(load(TINY), dataclasses.replace(cluster, memory=2 ** 40), 1)[0]


values = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)


@settings(max_examples=60, deadline=None)
@given(overrides=st.lists(st.builds("{}={}".format, st.sampled_from(
    ["checkpoint.dir", "model.n_layers", "data.path"]), values), max_size=4),
    device=st.sampled_from(["cpu", "cuda"]), nodes=st.integers(1, 64))
def test_line_parses_back_to_the_plan_arguments(best, overrides, device, nodes):
    cluster = dataclasses.replace(load_cluster("dgx-a100"), device=device, ranks_per_node=4)
    words = shlex.split(search.slurm_line(best, nodes, cluster, TINY, overrides))
    template = "jobs/gpu.sbatch" if device == "cuda" else "jobs/multi-node.sbatch"
    at = words.index(template)
    opts = [f"--nodes={nodes}", "--ntasks-per-node=4"]
    opts += ["--gpus-per-node=4"] if device == "cuda" else []
    assert words[:at] == ["sbatch", *opts]
    assert words[at + 1] == TINY
    assert words[at + 2:at + 4] == ["--run-name", "tiny-llama"]  # the run continues
    sets = words[at + 4:]
    assert sets[0::2] == ["--set"] * (len(sets) // 2)
    # the user's overrides first (in order), the layout's after them, the device last
    assert sets[1::2] == [*overrides, *best.sets, f"model.device={device}"]


def _through_bash(line: str) -> list[str]:
    """The words a shell makes of a printed line (what a user pasting it runs)."""
    out = subprocess.run(["bash", "-c", f'printf "%s\\0" {line}'], capture_output=True,
                         text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_printed_set_lines_paste_into_a_shell(best):
    """The --set lines `plan --search` prints (names and sizes as strings included) give,
    through `bash -c`, overrides that load the same layout."""
    picked = dataclasses.replace(best.cfg, topology=dataclasses.replace(
        best.cfg.topology, shard_within="node", cp_kind="ulysses", cp=2))
    cand = dataclasses.replace(best, cfg=picked)
    words = _through_bash(search.set_line(cand.sets))
    assert words[0::2] == ["--set"] * (len(words) // 2)
    cfg = load(TINY, words[1::2])
    assert (cfg.topology.shard_within, cfg.topology.cp_kind) == ("node", "ulysses")
    assert load(TINY, ['topology.shard_within=4']).topology.shard_within == "4"  # unquoted
    cluster = dataclasses.replace(load_cluster("dgx-a100"), ranks_per_node=4)
    line = search.slurm_line(cand, 2, cluster, TINY, ["checkpoint.dir=/a b"])
    assert _through_bash(line) == shlex.split(line)


def test_cluster_device_is_checked_and_shipped_gpus_say_cuda():
    assert load_cluster("dgx-a100").device == "cuda"
    assert load_cluster("cpu-epyc-7763").device == "cpu"
    raw = {"ranks_per_node": 4, "memory": 1, "peak_flops": {"float32": 1e12},
           "link": {"intra": {"latency": 0, "bandwidth": 1}, "inter": {"latency": 0,
                                                                   "bandwidth": 1}}}
    assert from_dict(raw).device == "cpu"
    with pytest.raises(ClusterError, match="device = 'gpu'; valid: cpu, cuda"):
        from_dict({**raw, "device": "gpu"})
