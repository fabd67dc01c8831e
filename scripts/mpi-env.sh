# Open MPI on one machine, for every local launch: the one source of these settings.
#   bash:      source scripts/mpi-env.sh        (tests/gpu/check.sh)
#   GNU make:  include scripts/mpi-env.sh       (Makefile)
#   Python:    benchmarks.mpi_env.read()        (tests/launch.py, python -m benchmarks)
# Only `export NAME=value` lines and `#` comments: no quotes, no `$`, no spaces in a value
# (make and bash would read them differently; benchmarks.mpi_env.read refuses them).
#
# Running as root (containers, CI):
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# More ranks than cores (laptops, CI): idle ranks yield the CPU instead of spinning, and
# oversubscription is allowed (Open MPI 4: rmaps_base; Open MPI 5: PRRTE's mapping policy).
export OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# Nonblocking all-reduce (libnbc: overlapped and nonblocking gradient reductions) as a ring:
# its default choice for a few ranks was 1.6x slower over TCP (docs/benchmarks.md, Overlap).
export OMPI_MCA_coll_libnbc_iallreduce_algorithm=1
