"""The foreign-checkpoint fuzz campaign in CI (benchmarks/fuzz_foreign.py; ``make bench``
runs the 10,000-case one): ``python -m benchmarks --only fuzz-foreign --size tiny`` converts
500 mutated torchtitan DCP, Megatron-LM and Hugging Face checkpoints (seed 64: opcode-level
and byte-level mutations of their ``.metadata``, ``common.pt`` and safetensors headers,
hand-written gadgets) with ``hpctrain import``. Every case ends in the same model as the
unmutated file or in one message with exit 2; none writes outside its scratch directory,
starts a process, imports a module outside the admitted list, changes a class process-wide,
reads a file outside the checkpoint or runs past 10 s."""

import json

import pytest
from launch import benchmarks

pytestmark = pytest.mark.e2e


@pytest.mark.slow(reason="500 conversions of mutated checkpoints in forked workers")
def test_500_mutated_checkpoints_are_the_same_model_or_one_refusal(tmp_path):
    proc = benchmarks(["--only", "fuzz-foreign", "--size", "tiny", "--repeats", "1", "--out",
                       str(tmp_path)], timeout=900, check=False)
    (res,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    notes = "\n".join(res.get("notes", [])) or res.get("error", "")
    assert "error" not in res, notes + proc.stdout[-3000:]
    outcomes = {r["outcome"]: r["cases"] for r in res["table"] if "outcome" in r}
    broken = {r["violation"]: r["cases"] for r in res["table"] if "violation" in r}
    assert sum(outcomes.values()) == 500, outcomes
    assert not broken and outcomes.get("violation", 0) == 0, notes
    # neither side is empty: mutations that keep the model and mutations refused both occur
    assert outcomes["same model (exit 0)"] > 0 and outcomes["refused (exit 2, one message)"] > 0
    assert res["check"]["ok"] and proc.returncode == 0, notes
