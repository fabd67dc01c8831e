"""The equivalence core under another MPI family (issue 24), run by ``tests/mpich_core.sh``
with the interpreter of a second venv built against MPICH and its parallel HDF5 (not by
``tests/run_all.sh``: the CI time budget decides where it runs).

Every launch goes through ``tests/launch.py`` and so through the launcher abstraction, which
picks Hydra's ``mpiexec.mpich`` for an MPICH-built mpi4py. One one-rank baseline (6 steps,
checkpoints at 3 and 6) is shared by the dense layouts: dp x tp with sequence parallelism and
ZeRO-1, pp 1F1B (whose step-3 checkpoint is resumed at dp x tp), pp interleaved; ep has its
MoE baseline. Across families, with ``OTHER_PY`` (default ``.venv/bin/python``, the Open MPI
venv): the same one-rank run gives the same numbers, each family's ``inspect --verify``
accepts the other's file, and a checkpoint written under Open MPI resumes under this MPI
on another layout. Float64, 1e-9 relative, as every equivalence test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from launch import (
    LAUNCHER,
    ROOT,
    assert_same,
    baseline,
    ckpt,
    env,
    hpctrain,
    read_run,
    rel_err,
    train_args,
    train_cli,
)

pytestmark = pytest.mark.e2e

COMMON = ("train.steps=6", "checkpoint.every=3")
MOE = ("model.num_experts=4", "model.moe_every=2")
OTHER_PY = os.environ.get("OTHER_PY", str(ROOT / ".venv" / "bin" / "python"))


def first_log_line(run) -> str:
    return (run.run_dir / "train.log").read_text().splitlines()[0]


def assert_tail(run, ref, start: int, what: str) -> None:
    """``run`` resumed at step ``start`` continues the reference exactly."""
    assert len(run.losses) == len(ref.losses) - start, (what, run.losses)
    for name, a, b in (("losses", run.losses, ref.losses[start:]),
                       ("grad norms", run.grad_norms, ref.grad_norms[start:])):
        assert rel_err(a, b) <= 1e-9, f"{what}: {name} {a} vs {b}"
    for name, value in ref.params.items():
        assert rel_err(run.params[name], value) <= 1e-9, f"{what}: {name}"


def other(args: list[str], n: int | None = None, timeout: float = 300):
    """Under the other MPI: ``OTHER_PY ARGS`` (n None: one process) or through its own
    launcher (``OTHER_PY -m hpctrain.job.launch -n N -- OTHER_PY -m mpi4py ARGS``)."""
    assert Path(OTHER_PY).is_file(), f"OTHER_PY={OTHER_PY}: the other MPI's venv is missing"
    e = {k: v for k, v in env().items() if k != "HPCTRAIN_LAUNCHER"}
    cmd = ([OTHER_PY, *args] if n is None else
           [OTHER_PY, "-m", "hpctrain.job.launch", "-n", str(n), "--", OTHER_PY, "-m", "mpi4py",
            *args])
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc


def test_this_is_another_mpi_family(session_dir):
    """The job's point: the ranks run on Hydra and MPICH, not on the default Open MPI."""
    assert LAUNCHER.family == "hydra", LAUNCHER
    ref = baseline(session_dir, *COMMON)
    assert first_log_line(ref).split("[hpctrain] ")[1].startswith("MPI: MPICH"), \
        first_log_line(ref)


def test_dp2_tp2_sequence_parallel_zero1(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    run = train_cli(tmp_path / "r", 4, *COMMON, "topology.dp=2", "topology.tp=2",
                    "topology.sequence_parallel=true", "optim.zero=1")
    assert_same(run, ref, what="dp=2 x tp=2 + SP, ZeRO-1")


def test_pp2_1f1b_then_resumed_at_dp2_tp2(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    run = train_cli(tmp_path / "pp", 4, *COMMON, "topology.pp=2", "topology.dp=2",
                    'schedule.kind="1f1b"')
    assert_same(run, ref, what="pp=2 1f1b x dp=2")
    back = train_cli(tmp_path / "back", 4, "train.steps=6", "topology.dp=2", "topology.tp=2",
                     f"checkpoint.resume={ckpt(run, 3)}")
    assert_tail(back, ref, 3, "pp=2 x dp=2 step 3 -> dp=2 x tp=2")


def test_pp2_interleaved(tmp_path, session_dir):
    ref = baseline(session_dir, *COMMON)
    run = train_cli(tmp_path / "r", 2, *COMMON, "topology.pp=2", 'schedule.kind="interleaved"',
                    "schedule.virtual_stages=2")
    assert_same(run, ref, what="pp=2 interleaved")


def test_ep2(tmp_path, session_dir):
    # One rank takes both dp ranks' sequences as one microbatch: the same routing groups
    # (load-balancing statistics are per microbatch), as tests/matrix/test_moe_equivalence.py.
    ref = baseline(session_dir, *COMMON, *MOE, "train.micro_batch_size=2")
    run = train_cli(tmp_path / "r", 2, *COMMON, *MOE, "topology.dp=2", "topology.ep=2")
    assert_same(run, ref, what="dp=2 x ep=2")


def test_files_cross_families(tmp_path, session_dir):
    """Open MPI's one-rank run equals this MPI's; each family verifies the other's file; this
    MPI resumes Open MPI's step-3 checkpoint at dp=2 and continues exactly."""
    ref = baseline(session_dir, *COMMON)
    proc = other(train_args(tmp_path / "ompi", *COMMON), n=1)
    theirs = read_run(tmp_path / "ompi", proc.stdout)
    assert first_log_line(theirs).split("[hpctrain] ")[1].startswith("MPI: Open MPI"), \
        first_log_line(theirs)
    assert_same(theirs, ref, what="one rank, Open MPI against MPICH")
    assert "verify ok" in hpctrain(["inspect", str(ckpt(theirs, 6)), "--verify"]).stdout
    assert "verify ok" in other(["-m", "hpctrain", "inspect", str(ckpt(ref, 6)),
                                 "--verify"]).stdout
    back = train_cli(tmp_path / "back", 2, "train.steps=6", "topology.dp=2",
                     f"checkpoint.resume={ckpt(theirs, 3)}")
    assert_tail(back, ref, 3, "Open MPI one rank step 3 -> MPICH dp=2")
