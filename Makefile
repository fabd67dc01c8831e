# hpctrain: two commands on a fresh machine.
#   make run    set up what is missing, then train the demo preset on 4 ranks
#   make test   set up what is missing, then run the whole test suite
# Overridable: NP (ranks for `make run`), TORCH_SPEC (e.g. torch==2.13.0 or a CUDA build),
#              PYTEST_ARGS, RUN_DIR.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
# Running as root (containers, CI) and more ranks than cores (laptops, CI) need these.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_mpi_yield_when_idle := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMP_NUM_THREADS ?= 1
export HDF5_USE_FILE_LOCKING ?= FALSE
export PRTE_MCA_rmaps_default_mapping_policy ?= :oversubscribe

.PHONY: setup run test lint clean

setup:
	@bash scripts/setup.sh

run: setup
	mpirun -n $(NP) $(PY) -m mpi4py -m hpctrain train share/configs/demo.toml \
	    --run-dir $(RUN_DIR) --set topology.dp=$(NP)

test: setup
	$(PY) -m ruff check hpctrain tests
	bash tests/run_all.sh $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check hpctrain tests

clean:
	rm -rf runs .pytest_cache
