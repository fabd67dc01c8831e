# hpctrain: two commands on a fresh machine.
#   make run    set up what is missing, then train the demo preset on 4 ranks
#   make test   set up what is missing, then run the whole test suite
#   make test-fast  the quick tier (under 2 minutes on 2 cores): ruff, tests/unit but those
#               marked `slow`, tests/mpi at 2 ranks, and one end-to-end smoke run (tests
#               marked `smoke`: `hpctrain train` under the launcher at 2 ranks against 1 rank)
#   make bench  set up what is missing, then run the benchmarks (python -m benchmarks)
#   make test-mpich  the site-stack job: the equivalence core under MPICH (tests/mpich_core.sh)
# Overridable: MPI_IMPL (openmpi | mpich: the MPI set-up installs on Debian; mpich uses
#              VENV=.venv-mpich), MPICC / HDF5_DIR (a site's MPI and parallel HDF5, see
#              docs/slurm.md), VENV, NP (ranks for `make run`), TORCH_SPEC (e.g.
#              torch==2.13.0 or a CUDA build),
#              PYTEST_ARGS, RUN_DIR, BENCH_ARGS (e.g. --size tiny --only ddp --repeats 1).
SHELL := /bin/bash
VENV ?= $(if $(filter mpich,$(MPI_IMPL)),.venv-mpich,.venv)
PY := $(VENV)/bin/python
NP ?= 4
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Ranks are started by the launcher abstraction (hpctrain/job/launch.py: Open MPI mpirun,
# Hydra mpiexec or srun, with its settings for root and more ranks than cores); the MPI is
# the one the venv's mpi4py was built for (MPI_IMPL=mpich VENV=.venv-mpich: MPICH).
LAUNCH = $(PY) -m hpctrain.job.launch
export OMP_NUM_THREADS ?= 1
export HDF5_USE_FILE_LOCKING ?= FALSE

.PHONY: setup run test test-fast test-mpich lint bench clean

setup:
	@VENV=$(VENV) bash scripts/setup.sh

run: setup
	$(LAUNCH) -n $(NP) -- $(PY) -m mpi4py -m hpctrain train share/configs/demo.toml \
	    --run-dir $(RUN_DIR) --set topology.dp=$(NP)

test: setup
	$(PY) -m ruff check hpctrain tests benchmarks
	PY=$(PY) bash tests/run_all.sh $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m ruff check hpctrain tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/unit $(PYTEST_ARGS)
	$(LAUNCH) -n 2 -- $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi tests/mpi \
	    $(PYTEST_ARGS)
	$(PY) -m pytest -q -p no:cacheprovider -m smoke tests/e2e $(PYTEST_ARGS)

test-mpich: setup
	bash tests/mpich_core.sh $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check hpctrain tests benchmarks

bench: setup
	$(PY) -m benchmarks --out runs/bench $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
