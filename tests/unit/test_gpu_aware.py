"""CUDA-awareness on every MPI family: the decision table of ``comm.gpu.decide`` (the override,
Cray MPICH, MVAPICH, MPICH 4's query, Open MPI's query, the default) and ``describe``
naming the rule that decided. Pure: fake environments, library texts and C functions."""

from __future__ import annotations

import pytest

from hpctrain.comm import gpu

OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4"
MPICH = "MPICH Version:\t4.1.2\nMPICH Release date: ..."
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :..."
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS\n"


def mpich_query(supported: int, seen: list):
    def fn(kind, out):  # int MPIX_GPU_query_support(int gpu_type, int *is_supported)
        seen.append(kind.value)
        out._obj.value = supported
        return 0
    return fn


def lookup(**symbols):
    return lambda name: symbols.get(name)


def never(name):
    raise AssertionError(f"looked up {name} although an earlier rule decides")


@pytest.mark.parametrize("value,aware", [("1", True), ("0", False)])
def test_override_wins_over_everything(value, aware):
    env = {"HPCTRAIN_GPU_AWARE_MPI": value, "MPICH_GPU_SUPPORT_ENABLED": "1" if not aware else "0"}
    for lib in (OPEN_MPI, MPICH, CRAY, MVAPICH):
        a = gpu.decide(env, lib, never)
        assert a == gpu.Awareness(aware, f"HPCTRAIN_GPU_AWARE_MPI={value}")


def test_override_must_be_0_or_1():
    with pytest.raises(ValueError, match="0 or 1"):
        gpu.decide({"HPCTRAIN_GPU_AWARE_MPI": "yes"}, OPEN_MPI, never)


@pytest.mark.parametrize("env,aware", [({"MPICH_GPU_SUPPORT_ENABLED": "1"}, True),
                                       ({"MPICH_GPU_SUPPORT_ENABLED": "0"}, False), ({}, False)])
def test_cray_mpich_follows_its_variable(env, aware):
    a = gpu.decide(env, CRAY, never)
    assert a.aware is aware and a.decided_by.startswith("Cray MPICH, MPICH_GPU_SUPPORT_ENABLED")


@pytest.mark.parametrize("env,aware", [({"MV2_USE_CUDA": "1"}, True), ({}, False)])
def test_mvapich_follows_mv2_use_cuda(env, aware):
    a = gpu.decide(env, MVAPICH, never)
    assert a.aware is aware and a.decided_by.startswith("MVAPICH, MV2_USE_CUDA")


def test_cray_variable_means_nothing_to_another_mpi():
    a = gpu.decide({"MPICH_GPU_SUPPORT_ENABLED": "1", "MV2_USE_CUDA": "1"}, OPEN_MPI,
                   lookup(MPIX_Query_cuda_support=lambda: 0))
    assert a == gpu.Awareness(False, "Open MPI's MPIX_Query_cuda_support()")


@pytest.mark.parametrize("supported", [0, 1])
def test_mpich4_query_asks_for_cuda_and_is_preferred(supported):
    seen: list = []
    # MPICH 4 exports both queries; its own GPU query decides.
    a = gpu.decide({}, MPICH, lookup(MPIX_GPU_query_support=mpich_query(supported, seen),
                                     MPIX_Query_cuda_support=lambda: 1 - supported))
    assert a == gpu.Awareness(bool(supported), "MPICH's MPIX_GPU_query_support(CUDA)")
    assert seen == [gpu.MPIX_GPU_SUPPORT_CUDA] == [0]


@pytest.mark.parametrize("supported", [0, 1])
def test_open_mpi_query(supported):
    a = gpu.decide({}, OPEN_MPI, lookup(MPIX_Query_cuda_support=lambda: supported))
    assert a == gpu.Awareness(bool(supported), "Open MPI's MPIX_Query_cuda_support()")


def test_no_query_no_override_is_host_staging():
    a = gpu.decide({}, INTEL, lookup())
    assert a == gpu.Awareness(False, "no query in this MPI and no override")


def test_describe_names_the_path_and_the_rule(monkeypatch):
    monkeypatch.setattr(gpu, "_AWARE", gpu.Awareness(True, "MPICH's MPIX_GPU_query_support(CUDA)"))
    assert gpu.describe() == ("GPU buffers to MPI via CUDA-aware MPI (zero-copy), decided by "
                              "MPICH's MPIX_GPU_query_support(CUDA)")
    monkeypatch.setattr(gpu, "_AWARE", gpu.Awareness(False, "HPCTRAIN_GPU_AWARE_MPI=0"))
    assert gpu.describe().startswith("GPU buffers to MPI via host staging (pinned buffers), "
                                     "decided by HPCTRAIN_GPU_AWARE_MPI=0")


def test_this_process_decides_without_loading_another_mpi(monkeypatch):
    """The real query on this machine's MPI (whichever family the venv was built for) ends in
    one of the rules and never aborts (no second MPI library is loaded and called)."""
    monkeypatch.delenv("HPCTRAIN_GPU_AWARE_MPI", raising=False)
    a = gpu.query()
    assert a.decided_by in ("Open MPI's MPIX_Query_cuda_support()",
                            "MPICH's MPIX_GPU_query_support(CUDA)"), a
