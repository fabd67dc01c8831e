# hpctrain: two commands on a fresh machine.
#   make run    set up what is missing, then train the demo preset on 4 ranks
#   make test   set up what is missing, then run the whole test suite
#   make bench  set up what is missing, then run the benchmarks (python -m benchmarks)
# Overridable: NP (ranks for `make run`), TORCH_SPEC (e.g. torch==2.13.0 or a CUDA build),
#              PYTEST_ARGS, RUN_DIR, BENCH_ARGS (e.g. --size tiny --only ddp --repeats 1).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Running as root (containers, CI) and more ranks than cores (laptops, CI): Open MPI's
# settings, one source for make, bash and Python.
include scripts/mpi-env.sh
export OMP_NUM_THREADS ?= 1
export HDF5_USE_FILE_LOCKING ?= FALSE

.PHONY: setup run test lint bench clean

setup:
	@bash scripts/setup.sh

run: setup
	mpirun -n $(NP) $(PY) -m mpi4py -m hpctrain train share/configs/demo.toml \
	    --run-dir $(RUN_DIR) --set topology.dp=$(NP)

test: setup
	$(PY) -m ruff check hpctrain tests benchmarks
	bash tests/run_all.sh $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check hpctrain tests benchmarks

bench: setup
	$(PY) -m benchmarks --out runs/bench $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
